"""`SamplingParams`: how one request is decoded, a drop-in for vLLM's class of the same name.

Every value comes from a user (script, CLI or the OpenAI server), so `__post_init__` checks each
field and raises `ValueError` / `TypeError` with a message naming the field, the bad value and
what is allowed. Normalization happens here too (`stop` becomes a list, `top_k=-1` becomes 0), so
the engine and the sampler only ever see one spelling of each setting.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

# Temperatures below this are treated as greedy decoding (same threshold as vLLM).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` carries (vLLM's enum of the same name)."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass
class SamplingParams:
    """Decoding settings of one request; see the vLLM docs for the meaning of each field.

    `best_of` is accepted for compatibility and ignored. `prompt_logprobs` is not supported yet.
    `spaces_between_special_tokens` only matters for slow (Python) tokenizers.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) = all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the model's context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top-n per generated token; 0 = only the sampled token
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # stop_token_ids plus the model's EOS ids (see update_from_generation_config)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of)
            if self.best_of < 1:
                raise ValueError(f"best_of must be >= 1 or None, got {self.best_of}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:  # torch.Generator takes a 64-bit seed
                raise ValueError(f"seed must fit in 64 bits [-2^63, 2^63), got {self.seed}")

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}"
                )
        if self.prompt_logprobs is not None:
            raise ValueError(
                f"prompt_logprobs is not supported yet; use None, got {self.prompt_logprobs!r}"
            )

        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            _check_bool(name, getattr(self, name))
        self.output_kind = self._normalize_output_kind(self.output_kind)

        self._all_stop_token_ids = set(self.stop_token_ids)

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must contain only str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError(f"stop must not contain an empty string, got {list(stop)!r}")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple, set, frozenset)):
            raise TypeError(
                f"stop_token_ids must be a list of int, got {type(ids).__name__} {ids!r}"
            )
        out = [_check_int("stop_token_ids[]", i) for i in ids]
        if any(i < 0 for i in out):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {out}")
        return out

    @staticmethod
    def _normalize_output_kind(kind: Any) -> RequestOutputKind:
        if isinstance(kind, str):
            try:
                return RequestOutputKind[kind.upper()]
            except KeyError:
                pass
        elif _is_int(kind) and int(kind) in RequestOutputKind._value2member_map_:
            return RequestOutputKind(int(kind))
        allowed = ", ".join(k.name.lower() for k in RequestOutputKind)
        raise ValueError(f"output_kind must be one of {allowed}, got {kind!r}")

    # ---- derived views -----------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request: `stop_token_ids` plus EOS ids the engine registered."""
        return self._all_stop_token_ids

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Register the model's EOS ids, as vLLM does.

        `model_eos_token_id` (the tokenizer's EOS) ends the request unless `ignore_eos`; that
        check stays with the engine. Extra EOS ids of `generation_config` (e.g. Qwen's
        `<|endoftext|>` next to `<|im_end|>`) become ordinary stop tokens unless `ignore_eos`.
        """
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if _is_int(eos_ids) else set(eos_ids)
        extra.discard(model_eos_token_id)
        if extra:
            self._all_stop_token_ids.update(extra)
            if not self.ignore_eos:
                self.stop_token_ids = sorted(extra | set(self.stop_token_ids))

    def clone(self) -> SamplingParams:
        """A deep copy, so that one request's changes (EOS ids) never leak into another's."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            text = value.name.lower() if isinstance(value, RequestOutputKind) else repr(value)
            parts.append(f"{f.name}={text}")
        return f"SamplingParams({', '.join(parts)})"

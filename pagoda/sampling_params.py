"""`SamplingParams`: how one request is decoded, a drop-in for vLLM's class of the same name.

Every value comes from a user (script, CLI or the OpenAI server), so `__post_init__` checks each
field and raises `ValueError` / `TypeError` with a message naming the field, the bad value and
what is allowed. Normalization happens here too (`stop` becomes a list, `top_k=-1` becomes 0), so
the engine and the sampler only ever see one spelling of each setting.
"""

from __future__ import annotations

import copy
import enum
import json
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


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint for a request (vLLM's class of the same name); exactly one is set.

    `json`: a JSON schema (dict or JSON text); `json_object`: any JSON object; `regex`: a regular
    expression the whole output matches; `choice`: the output is one of these strings; `grammar`:
    an EBNF grammar in xgrammar's dialect (GBNF-compatible, root rule `root`; Lark is not
    accepted). `disable_any_whitespace` makes JSON output compact (no free whitespace).
    Whether a schema, regex or grammar is valid is checked when the engine receives the request.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"structured_outputs.json is not valid JSON: {e.msg} at {e.pos}"
                    ) from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise TypeError(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(parsed).__name__}"
                )
        _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"structured_outputs.{name} must be a str, got {type(value).__name__}"
                )
            if value is not None and not value.strip():
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)):
                raise TypeError(
                    f"structured_outputs.choice must be a list of str, got "
                    f"{type(self.choice).__name__}"
                )
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            for c in self.choice:
                if not isinstance(c, str):
                    raise TypeError(
                        f"structured_outputs.choice must contain only str, got "
                        f"{type(c).__name__} {c!r}"
                    )
            object.__setattr__(self, "choice", list(self.choice))
        set_ = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            got = ", ".join(set_) if set_ else "none"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}; got {got}"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.dumps(
                json.loads(value) if isinstance(value, str) else value, sort_keys=True
            )
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """Decoding settings of one request; see the vLLM docs for the meaning of each field.

    `best_of` is accepted for compatibility and ignored. `spaces_between_special_tokens` only
    matters for slow (Python) tokenizers. `truncate_prompt_tokens=k` keeps the last k prompt
    tokens (-1: as many as the context allows while leaving room for one generated token).
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
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias, in [-100, 100])
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    # stop_token_ids plus the model's EOS ids (see update_from_generation_config)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    # bad_words as token id sequences (see update_from_tokenizer)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

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
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got "
                    f"{self.prompt_logprobs}"
                )
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                try:
                    self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
                except TypeError as e:
                    raise TypeError(f"structured_outputs: {e}") from None
            elif not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(
                    "structured_outputs must be a StructuredOutputsParams (or a dict of its "
                    f"fields), got {type(self.structured_outputs).__name__}"
                )
        self.bad_words = self._normalize_bad_words(self.bad_words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple, set, frozenset)):
                raise TypeError(
                    f"allowed_token_ids must be a list of int, got {type(ids).__name__} {ids!r}"
                )
            ids = [_check_int("allowed_token_ids[]", i) for i in ids]
            if not ids:
                raise ValueError(
                    f"allowed_token_ids must not be empty (None = all tokens), got {ids}"
                )
            if any(i < 0 for i in ids):
                raise ValueError(f"allowed_token_ids must be token ids >= 0, got {ids}")
            self.allowed_token_ids = ids
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(
                    f"logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}"
                )
            bias: dict[int, float] = {}
            for tid, value in self.logit_bias.items():
                tid = _check_int("logit_bias key", int(tid) if isinstance(tid, str) else tid)
                value = _check_float(f"logit_bias[{tid}]", value)
                if tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid}")
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias[{tid}] must be in [-100, 100], got {value}")
                bias[tid] = value
            self.logit_bias = bias or None
        if self.truncate_prompt_tokens is not None:
            k = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if k < 1 and k != -1:
                raise ValueError(
                    f"truncate_prompt_tokens must be >= 1, -1 (the context limit) or None, got {k}"
                )
            self.truncate_prompt_tokens = k

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
    def _normalize_bad_words(words: Any) -> list[str] | None:
        if words is None:
            return None
        if isinstance(words, str):
            raise TypeError(f"bad_words must be a list of str, not a single str {words!r}")
        if not isinstance(words, (list, tuple)):
            raise TypeError(f"bad_words must be a list of str, got {type(words).__name__}")
        for w in words:
            if not isinstance(w, str):
                raise TypeError(f"bad_words must contain only str, got {type(w).__name__} {w!r}")
            if not w.strip():
                raise ValueError(f"bad_words must not contain blank strings, got {list(words)!r}")
        return list(words)

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

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` as token id sequences (filled by `update_from_tokenizer`)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int) -> None:
        """Tokenize `bad_words`, as vLLM does: each word alone and after a space.

        A sequence's last token is banned whenever the output ends with the others.
        """
        self._bad_words_token_ids = []
        for word in self.bad_words or []:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if plain:
                self._bad_words_token_ids.append(plain)
            # The spaced form only when it is a different token sequence of the same length
            # (vLLM's rule: a word split differently after a space is a different word).
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                self._bad_words_token_ids.append(spaced)
        bad = sorted({t for ids in self._bad_words_token_ids for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(
                f"bad_words tokenize to ids {bad} outside the model's vocabulary [0, {vocab_size})"
            )

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

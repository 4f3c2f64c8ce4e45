"""One generation request as the engine core sees it: token ids in, token ids out.

`Request` is mutated in place by the scheduler (`num_computed_tokens`, `status`) and by the
KV cache manager (`block_hashes`). It holds no text and no tensors, so the scheduler and the
KV cache manager stay pure Python; detokenization lives elsewhere.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.sampling_params import SamplingParams
    from pagoda.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason of a final status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still distinct
class Request:
    """A request's tokens, progress and status; see docs/architecture.md for the contract."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    lora_key: str | None = None  # adapter identity, part of every block hash
    # (offset, length, hash) of each image's placeholder tokens.
    mm_hashes: list[tuple[int, int, str]] = field(default_factory=list)
    # Images for the runner (NumPy, read-only; the scheduler only passes the reference on).
    mm_inputs: MultiModalInputs | None = None
    # The grammar that constrains its output (pagoda.structured_output): the scheduler admits
    # the request once it is compiled and advances it with every sampled token.
    structured_output: StructuredOutputRequest | None = None

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    # Tokens sampled by a step still running on the device (async scheduling): 0 or 1. They
    # count as computed-to-be inputs for scheduling but are not in all_token_ids yet.
    num_pending_tokens: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=-1)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    stop_reason: int | str | None = field(init=False, default=None)
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    # Speculative decoding: the proposer's drafts for the next step (consumed by schedule()),
    # and what verification made of them so far.
    spec_token_ids: list[int] = field(init=False, default_factory=list)
    # The n-gram proposer's index of this request's history (engine/ngram_proposer.py).
    ngram_index: Any = field(init=False, default=None)
    # A proposal made while decoding plainly, checked against the tokens that follow it
    # (engine/core.py `_shadow_proposals`): (its position, its drafts).
    shadow_drafts: tuple[int, list[int]] | None = field(init=False, default=None)
    num_spec_steps: int = field(init=False, default=0)  # steps that verified >= 1 draft
    num_draft_tokens: int = field(init=False, default=0)
    num_accepted_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        # A separate list: outputs are appended here while the prompt stays untouched.
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    @property
    def needs_sync(self) -> bool:
        """Its sampling reads the host-side token history every step (penalties, min_tokens,
        bad words of several tokens), so the step after one that sampled for it cannot be
        scheduled before the token lands. (A grammar does not need this: its bitmask is filled
        after the previous token landed, while the step's forward runs; see EngineCore.)"""
        p = self.sampling_params
        return bool(
            p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
            or (p.min_tokens or 0) > 0
            or any(len(ids) > 1 for ids in p.bad_words_token_ids)
        )

    def extra_keys(self, start: int, end: int) -> tuple:
        """What besides token ids identifies the KV of tokens [start, end).

        The adapter changes every layer's KV, and image placeholder tokens are identical across
        images, so both must be part of the block hash for a prefix hit to be correct.
        """
        if self.lora_key is None and not self.mm_hashes:
            return ()  # the common case, kept allocation-free
        keys: list = [] if self.lora_key is None else [self.lora_key]
        # A handful of images per request at most: a linear scan is cheaper than bisecting.
        for offset, length, mm_hash in self.mm_hashes:
            if offset < end and offset + length > start:
                keys.append(mm_hash)
        return tuple(keys)

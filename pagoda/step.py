"""The step description: what the scheduler hands the model runner for one engine step.

`SchedulerOutput` (the requests of the step, running first) of `ScheduledRequest` (one request's
share: its new tokens, block table, sampling parameters), and `DraftRequest` (what a draft model
proposes from after a step). Plain data that lives below both the engine, which builds it, and
the worker, which reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step. The lists are live references, not copies."""

    req_id: str
    all_token_ids: list[int]
    num_computed_tokens: int  # before this step, prefix-cache hits included
    num_new_tokens: int  # tokens computed this step: a prompt chunk, or 1 (+ drafts) for a decode
    block_ids: list[int]  # covers all computed + new tokens
    sampling_params: SamplingParams
    prompt_len: int
    output_token_ids: list[int]
    eos_token_id: int | None = None  # the sampler masks it until min_tokens are out
    lora_key: str | None = None  # the request's adapter (Request.lora_key); None: base model
    mm_inputs: MultiModalInputs | None = None  # Request.mm_inputs: images, M-RoPE positions
    structured_output: Any = None  # Request.structured_output: its grammar (bitmask rows)
    # True when this step reaches the last token (known or pending), so its logits give the
    # next one. With async scheduling the last input token may still be on the device: then
    # num_computed_tokens + num_new_tokens == len(all_token_ids) + 1 at schedule time.
    do_sample: bool = False
    # Speculative decoding: draft tokens verified this step, the last num_new_tokens inputs
    # (after the request's last known token); the runner emits 1 + the accepted ones.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # running first, then newly admitted, FCFS
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # since the previous schedule()


@dataclass(frozen=True)
class DraftRequest:
    """A request the draft model proposes for after a step (speculative decoding)."""

    req_id: str
    block_ids: list[int]  # the scheduler's list: covers position + num_tokens - 1 (lookahead)
    token_id: int  # the newest token, not in the KV cache yet
    position: int  # its position
    num_tokens: int  # drafts wanted (>= 1)

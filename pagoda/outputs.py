"""What generation returns: `RequestOutput` with one `CompletionOutput` per sample.

Field names follow vLLM's offline API so that scripts written for it work unchanged.
Streaming callers receive the same objects with `finished=False` and, in delta mode,
only the text and tokens produced since the previous output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token is always present).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (all samples of the request): verify steps that checked >= 1 draft,
    # drafts checked, drafts accepted.
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts; None without speculation."""
        if not self.spec_num_draft_tokens:
            return None
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the target's own), >= 1."""
        if not self.spec_num_steps:
            return None
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_steps

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None)

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={texts!r}, finished={self.finished})"
        )

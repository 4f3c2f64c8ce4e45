"""Turn a batch of next-token logits into sampled token ids (+ logprobs), vLLM semantics.

Order: grammar bitmask → raw logprobs → allowed_token_ids / bad_words masks → logit_bias →
min_tokens mask →
repetition/frequency/presence penalties → greedy argmax, or temperature → top-k → top-p → min-p →
exponential race `argmax(p / q)`, `q ~ Exp(1)`. Seeded rows draw `q` from their own
`torch.Generator`, so their tokens do not depend on the batch. No host sync happens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of the rows that sample this step (one row per request).

    Optional tensors are None when no row uses the feature, so the sampler skips that work.
    `generators` holds the per-request generator of seeded random rows; the runner keeps each
    one alive across steps so that the request's stream of draws continues where it left off.
    """

    temperature: torch.Tensor  # [N] float32; < SAMPLING_EPS = greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [N] int64; 0 = off
    top_p: torch.Tensor | None = None  # [N] float32; 1.0 = off
    min_p: torch.Tensor | None = None  # [N] float32; 0.0 = off
    presence_penalties: torch.Tensor | None = None  # [N] float32; 0.0 = off
    frequency_penalties: torch.Tensor | None = None  # [N] float32; 0.0 = off
    repetition_penalties: torch.Tensor | None = None  # [N] float32; 1.0 = off
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # None = no row asked for logprobs
    min_tokens_blocked: dict[int, list[int]] = field(default_factory=dict)
    # Structured outputs: the grammar's next-token bitmask ([N, ceil(V / 32)] int32, bit set =
    # allowed, on the logits' device) and the rows it applies to.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | torch.Tensor | None = None  # [R] int32 on CUDA
    # row -> allowed token ids (every other token is masked)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> (bad word token id sequences, the row's output token ids so far)
    bad_words: dict[int, tuple[list[list[int]], list[int]]] = field(default_factory=dict)
    # row -> {token id: bias added to its logit}
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def from_sampling_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator] | None = None,
        eos_token_ids: Sequence[int | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the metadata of one step from each row's `SamplingParams`.

        `eos_token_ids[i]` (with the row's stop token ids) is masked while row i has fewer
        than `min_tokens` output tokens.
        """
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]

        def column(values: list, off: float, dtype: torch.dtype) -> torch.Tensor | None:
            if all(v == off for v in values):
                return None
            return to_device(values, dtype, device)

        min_tokens_blocked: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                blocked = set(p.all_stop_token_ids) | set(p.stop_token_ids)
                if eos_token_ids is not None and eos_token_ids[i] is not None:
                    blocked.add(eos_token_ids[i])
                if blocked:
                    min_tokens_blocked[i] = sorted(blocked)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=column([p.top_k for p in params], 0, torch.int64),
            top_p=column([p.top_p for p in params], 1.0, torch.float32),
            min_p=column([p.min_p for p in params], 0.0, torch.float32),
            presence_penalties=column([p.presence_penalty for p in params], 0.0, torch.float32),
            frequency_penalties=column([p.frequency_penalty for p in params], 0.0, torch.float32),
            repetition_penalties=column([p.repetition_penalty for p in params], 1.0, torch.float32),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            generators=generators or {},
            max_num_logprobs=max(logprobs) if logprobs else None,
            min_tokens_blocked=min_tokens_blocked,
            allowed_token_ids={
                i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids
            },
            bad_words={
                i: (p.bad_words_token_ids, output_token_ids[i])
                for i, p in enumerate(params)
                if p.bad_words_token_ids
            },
            logit_bias={i: p.logit_bias for i, p in enumerate(params) if p.logit_bias},
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # Column 0 is the sampled token, then the top-k of the raw distribution (k = max_num_logprobs)
    logprob_token_ids: torch.Tensor | None = None  # [N, k + 1] int64
    logprobs: torch.Tensor | None = None  # [N, k + 1] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64, 1 = most likely token


def to_device(
    values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host data → device tensor without a stream sync (pinned staging buffer on CUDA)."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        # A blocking copy synchronizes the stream, and a non-blocking one from pageable memory
        # can still wait for the GPU to drain; from pinned memory it returns at once.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token id lists → [N, L] int64, padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    # Filled in place in (pinned, on CUDA) host memory through a numpy view: numpy converts a
    # list ~4x faster than torch.tensor does, and prompts can be long.
    pin = device.type == "cuda"
    padded = torch.full((len(rows), width), pad, dtype=torch.int64, pin_memory=pin)  # [N, L]
    view = padded.numpy()
    for i, row in enumerate(rows):
        view[i, : len(row)] = row
    return padded.to(device, non_blocking=pin)


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask stop tokens (-inf) of rows that have not produced `min_tokens` yet."""
    if not md.min_tokens_blocked:
        return logits
    rows = [r for r, ids in md.min_tokens_blocked.items() for _ in ids]
    cols = [t for ids in md.min_tokens_blocked.values() for t in ids]
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device))
    # torch.full builds the value on the device; torch.tensor(-inf, device=...) would copy (sync).
    return logits.index_put(index, torch.full((), float("-inf"), device=device))


def pad_grammar_rows(rows: list[int]) -> list[int]:
    """The constrained rows, the last repeated up to a multiple of 16 (masking a row twice is
    masking it once). xgrammar's Triton kernel takes the row count as a specialized int, so a
    count of 1, a multiple of 16 or anything else would each compile it anew mid-serving; padded,
    every step shares one compiled variant."""
    return rows + rows[-1:] * (-len(rows) % 16)


def apply_grammar_bitmask(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask (-inf, in place) the tokens each constrained row's grammar does not allow next.

    xgrammar's own kernel: Triton on CUDA, C++ on the CPU. Only called when a row has a
    grammar, so xgrammar is imported only then.
    """
    if md.grammar_bitmask is None:
        return logits
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, md.grammar_bitmask, vocab_size=logits.shape[-1], indices=md.grammar_rows
    )
    return logits


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Add each row's `logit_bias` to the logits of its tokens (OpenAI's semantics)."""
    if not md.logit_bias:
        return logits
    device = logits.device
    r = [row for row, bias in md.logit_bias.items() for _ in bias]
    c = [t for bias in md.logit_bias.values() for t in bias]
    v = [b for bias in md.logit_bias.values() for b in bias.values()]
    index = (to_device(r, torch.int64, device), to_device(c, torch.int64, device))
    return logits.index_put(index, to_device(v, torch.float32, device), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask every token outside a row's `allowed_token_ids`."""
    if not md.allowed_token_ids:
        return logits
    device = logits.device
    rows = list(md.allowed_token_ids)
    masked = torch.zeros(logits.shape, dtype=torch.bool, device=device)  # [N, V]
    masked[to_device(rows, torch.int64, device)] = True
    r = [row for row, ids in md.allowed_token_ids.items() for _ in ids]
    c = [t for ids in md.allowed_token_ids.values() for t in ids]
    index = (to_device(r, torch.int64, device), to_device(c, torch.int64, device))
    masked = masked.index_put(index, torch.zeros((), dtype=torch.bool, device=device))
    return logits.masked_fill(masked, float("-inf"))


def apply_bad_words(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask a bad word's last token where the output already ends with the rest of it."""
    if not md.bad_words:
        return logits
    rows: list[int] = []
    cols: list[int] = []
    for row, (sequences, output) in md.bad_words.items():
        for seq in sequences:
            prefix = len(seq) - 1
            if prefix == 0 or (len(output) >= prefix and output[-prefix:] == seq[:-1]):
                rows.append(row)
                cols.append(seq[-1])
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device))
    return logits.index_put(index, torch.full((), float("-inf"), device=device))


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties."""
    if md.no_penalties:
        return logits
    num_rows, vocab = logits.shape
    device = logits.device
    # Token ids are scattered into one extra column, `vocab`, that padding lands in and that is
    # dropped afterwards, so the ragged lists need no Python loop per token.
    output_ids = _pad(md.output_token_ids, vocab, device)  # [N, Lo]
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]  # [N, V]
    output_seen = output_counts > 0  # [N, V]

    if md.repetition_penalties is not None:
        prompt_ids = _pad(md.prompt_token_ids, vocab, device)  # [N, Lp]
        prompt_seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
        prompt_seen.scatter_(1, prompt_ids, True)
        seen = prompt_seen[:, :vocab] | output_seen  # [N, V]
        penalty = md.repetition_penalties.to(logits.dtype).unsqueeze(1)  # [N, 1]
        # Shrink toward zero on both sides: positive logits are divided, negative multiplied.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties.to(logits.dtype).unsqueeze(1) * output_counts
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties.to(logits.dtype).unsqueeze(1) * output_seen
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    One ascending sort serves both. Ties at the k-th value are all kept.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [N, V] each
    if top_k is not None:
        # k = 0 means off: keep from position 0, i.e. everything.
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [N]
        kth_value = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # [N, 1]
        logits_sort = logits_sort.masked_fill(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)  # [N, V]
        cum_probs = probs_sort.cumsum(dim=-1)  # [N, V], ascending
        # Drop the low tail whose mass is <= 1 - p; the most likely token always survives.
        remove = cum_probs <= (1.0 - top_p.to(cum_probs.dtype)).unsqueeze(1)
        remove[:, -1] = False
        logits_sort = logits_sort.masked_fill(remove, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exp(1) is a draw from p.

    Seeded rows fill their own `q` row from their generator, so their draw depends on nothing
    else in the batch; the other rows share the default generator.
    """
    q = torch.empty_like(probs)  # [N, V]
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0 in float32; keep the division finite.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)  # [N]


def compute_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [N, k+1], logprobs [N, k+1], ranks [N]); column 0 is the sampled token."""
    sampled = sampled.unsqueeze(1)  # [N, 1]
    sampled_logprob = raw_logprobs.gather(1, sampled)  # [N, 1]
    # Rank 1 = most likely; strict ">" so a tie with the best token still ranks 1.
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1  # [N]
    topk_logprobs, topk_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [N, k] each
    ids = torch.cat([sampled, topk_ids], dim=1)  # [N, k + 1]
    logprobs = torch.cat([sampled_logprob, topk_logprobs], dim=1)  # [N, k + 1]
    return ids, logprobs, ranks


def process_logits(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 logits after every mask, bias and penalty — what greedy takes the argmax of and
    temperature scales —, the raw log-probs if a row asked for log-probs, else None).

    The one chain the sampler and the rejection sampler share, so a verify row sees exactly
    the distribution plain decoding would sample from.
    """
    logits = logits.float()  # [N, V]
    # The grammar comes first, as in vLLM, where the runner applies it before sampling.
    logits = apply_grammar_bitmask(logits, md)
    # Logprobs are those of the model's raw distribution (vLLM's default "raw_logprobs").
    raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
    logits = apply_allowed_token_ids(logits, md)
    logits = apply_bad_words(logits, md)
    logits = apply_logit_bias(logits, md)
    logits = apply_min_tokens(logits, md)
    logits = apply_penalties(logits, md)
    return logits, raw_logprobs


class Sampler(nn.Module):
    """Stateless; all per-request state arrives in `SamplingMetadata`."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits, raw_logprobs = process_logits(logits, md)  # [N, V]
        greedy_ids = None if md.all_random else logits.argmax(dim=-1)  # [N]
        if md.all_greedy:
            sampled = greedy_ids
        else:
            sampled = self._sample_random(logits, md)
            if greedy_ids is not None:
                sampled = torch.where(md.temperature < SAMPLING_EPS, greedy_ids, sampled)

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = compute_logprobs(
                raw_logprobs, sampled, md.max_num_logprobs
            )
        return out

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        # Greedy rows of a mixed batch get temperature 1 here; their result is discarded.
        temperature = torch.where(md.temperature < SAMPLING_EPS, 1.0, md.temperature)  # [N]
        logits = logits / temperature.unsqueeze(1)  # [N, V]
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        logits = apply_min_p(logits, md.min_p)
        probs = logits.softmax(dim=-1)  # [N, V]
        return exponential_race(probs, md.generators)


def logprobs_to_lists(
    output: SamplerOutput, num_logprobs: Sequence[int | None]
) -> list[tuple[list[int], list[float], int] | None]:
    """Per row: (token ids, logprobs, rank of the sampled token), or None if not requested.

    Row i keeps the sampled token and its own top `num_logprobs[i]`. This is a host sync.
    """
    if output.logprobs is None:
        return [None] * len(num_logprobs)
    ids = output.logprob_token_ids.tolist()
    logprobs = output.logprobs.tolist()
    ranks = output.sampled_ranks.tolist()
    return [
        None if k is None else (ids[i][: k + 1], logprobs[i][: k + 1], ranks[i])
        for i, k in enumerate(num_logprobs)
    ]

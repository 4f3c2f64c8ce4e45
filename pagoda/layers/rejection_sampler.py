"""Speculative verification: keep a prefix of the draft tokens, then one token of the target's own.

The target scores 1 + k positions per request in one forward; row j of a request holds the
target's logits after its known tokens and drafts d_0 .. d_{j-1}. Each row goes through the plain
sampler's own chain (`process_logits`: grammar, masks, logit bias, min_tokens, penalties, whose
history includes the drafts before it), so p_j is the one plain decoding would sample from.
Greedy rows accept d_j while d_j == argmax p_j. Random rows use speculative rejection sampling
(Leviathan et al., 2023) with a deterministic proposer (n-gram, a greedy draft model), whose q
is one-hot at d_j: accept d_j with probability p_j(d_j), else draw from p_j with d_j removed,
renormalized. Every emitted token is then distributed exactly as plain sampling would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.layers.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    process_logits,
)
from pagoda.sampling_params import SAMPLING_EPS


@dataclass
class RejectionOutput:
    """Per verify row (the 1 + k rows of each request, concatenated)."""

    # The token emitted at this row if the row is reached: the draft if accepted, else the
    # target's correction (or, on the last row, its bonus) token.
    token_ids: torch.Tensor  # [R] int64
    accepted: torch.Tensor  # [R] bool; always False on a request's last row
    logprob_token_ids: torch.Tensor | None = None  # [R, n + 1], column 0 = token_ids
    logprobs: torch.Tensor | None = None  # [R, n + 1]
    ranks: torch.Tensor | None = None  # [R]


def num_emitted(accepted: list[bool], num_rows: list[int]) -> list[int]:
    """Tokens each request emits: its accepted drafts, up to the first rejection, plus one."""
    out, start = [], 0
    for n in num_rows:
        a = 0
        while a < n - 1 and accepted[start + a]:
            a += 1
        out.append(a + 1)
        start += n
    return out


def target_probs(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Probabilities [R, V] of random rows from the processed logits (`process_logits`): the
    plain sampler's temperature, top-k, top-p, min-p."""
    temperature = torch.where(md.temperature < SAMPLING_EPS, 1.0, md.temperature)  # [R]
    scaled = processed / temperature.unsqueeze(1)
    scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
    scaled = apply_min_p(scaled, md.min_p)
    return scaled.softmax(dim=-1)


def rejection_sample(
    logits: torch.Tensor,
    md: SamplingMetadata,
    draft_ids: torch.Tensor,
    row_generators: list[torch.Generator | None],
) -> RejectionOutput:
    """Verify drafts against the target's logits.

    logits [R, V]: the target's rows. `md`: one row per verify row (rows of one request share
    its settings; their histories include the drafts before them). draft_ids [R] int64: the
    draft token each row verifies, -1 on a request's last row (which only emits).
    row_generators: the seeded request's generator for each of its rows, None for unseeded
    rows; draws are taken row by row in order, so a seeded request's output depends on nothing
    else in the batch.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    processed, raw_logprobs = process_logits(logits, md)  # [R, V]
    is_last = draft_ids < 0  # [R]: the runner marks each request's last row with -1
    draft = draft_ids.clamp(min=0)  # [R]
    # Greedy rows: the draft is kept iff it is the target's argmax; the correction is argmax.
    argmax = processed.argmax(dim=-1)  # [R]
    if md.all_greedy:  # no probabilities, no random draws
        accepted = (argmax == draft) & ~is_last
        return _output(torch.where(accepted, draft, argmax), accepted, raw_logprobs, md)
    probs = target_probs(processed, md)  # [R, V]
    greedy = md.temperature < SAMPLING_EPS  # [R]
    draft = draft.unsqueeze(1)  # [R, 1]

    # Random rows: uniform u for the acceptance test, Exp(1) noise for the correction draw.
    u = torch.empty(num_rows, device=device)
    noise = torch.empty(num_rows, vocab, device=device)
    if any(g is None for g in row_generators):
        u.uniform_()
        noise.exponential_()
    for row, gen in enumerate(row_generators):
        if gen is not None:
            u[row : row + 1].uniform_(generator=gen)
            noise[row].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    p_draft = probs.gather(1, draft).squeeze(1)  # [R]
    accept_random = u < p_draft  # min(1, p / q) with q(d) = 1
    # Correction: norm(max(p - q, 0)) = p without the draft (the race needs no normalizing).
    residual = probs.scatter(1, draft, 0.0)
    residual = torch.where(is_last.unsqueeze(1), probs, residual)
    # A row whose residual is all zero (p(d) = 1) always accepts; keep its draw finite.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    correction = residual.div_(noise).argmax(dim=-1)  # [R], the exponential race

    accepted = torch.where(greedy, argmax == draft.squeeze(1), accept_random) & ~is_last
    fallback = torch.where(greedy, argmax, correction)
    return _output(torch.where(accepted, draft.squeeze(1), fallback), accepted, raw_logprobs, md)


def _output(
    token_ids: torch.Tensor,
    accepted: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    md: SamplingMetadata,
) -> RejectionOutput:
    out = RejectionOutput(token_ids=token_ids, accepted=accepted)
    if raw_logprobs is not None:
        out.logprob_token_ids, out.logprobs, out.ranks = compute_logprobs(
            raw_logprobs, token_ids, md.max_num_logprobs
        )
    return out

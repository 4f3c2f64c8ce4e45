"""Rejection sampler: greedy equality, and the emitted tokens' distribution is the target's.

Chi-square tests draw many verify steps at once (each a request of 1 + k rows over fixed
logits) and compare the histogram of the first emitted token with the target's probabilities,
and of the bonus token given an accepted draft with the next row's, for temperature, top-k,
top-p, min-p and penalties (whose history includes the drafts before each row).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from scipy.stats import chisquare

from pagoda.layers.rejection_sampler import num_emitted, rejection_sample
from pagoda.layers.sampler import SamplingMetadata, apply_penalties, apply_top_k_top_p
from pagoda.sampling_params import SamplingParams

V = 12
PROMPT = [1, 2, 3]


def _md(params, outputs, prompts=None) -> SamplingMetadata:
    prompts = prompts or [[] for _ in params]
    return SamplingMetadata.from_sampling_params(params, prompts, outputs)


def test_greedy_accepts_while_draft_is_argmax() -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).tolist()
    # request 0: 3 drafts, the 3rd wrong; request 1: 4 drafts, all right (+ bonus)
    drafts = [argmax[0], argmax[1], (argmax[2] + 1) % V, -1]
    drafts += [argmax[4], argmax[5], argmax[6], -1]
    # request 1 has only 3 drafts: rows 4..7 are 3 drafts + last
    params = [SamplingParams(temperature=0)] * 8
    out = rejection_sample(logits, _md(params, [[]] * 8), torch.tensor(drafts), [None] * 8)
    accepted = out.accepted.tolist()
    assert accepted == [True, True, False, False, True, True, True, False]
    assert num_emitted(accepted, [4, 4]) == [3, 4]
    tokens = out.token_ids.tolist()
    assert tokens[:3] == argmax[:3]  # the third is the correction: the target's argmax
    assert tokens[4:8] == argmax[4:8]  # three drafts + the bonus


def _target(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """The plain sampler's distribution, computed independently of the rejection sampler."""
    logits = logits.clone().float().unsqueeze(0)
    md = _md([params], [output], [PROMPT])
    logits = apply_penalties(logits, md)
    logits = logits / params.temperature
    top_k = torch.tensor([params.top_k]) if params.top_k > 0 else None
    top_p = torch.tensor([params.top_p]) if params.top_p < 1 else None
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(-1)
    if params.min_p > 0:
        probs = torch.where(probs < probs.max() * params.min_p, 0.0, probs)
        probs = probs / probs.sum()
    return probs[0]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = int(counts.sum())
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() * n
    # pool tiny cells so the chi-square approximation holds (expected >= 5)
    obs = counts[support].double()
    keep = expected >= 5
    obs_k = torch.cat([obs[keep], obs[~keep].sum().unsqueeze(0)])
    exp_k = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    if exp_k[-1] == 0:
        obs_k, exp_k = obs_k[:-1], exp_k[:-1]
    if len(obs_k) < 2:
        return  # one cell: every draw is that token, which the support check covered
    exp_k = exp_k * (obs_k.sum() / exp_k.sum())  # float rounding of the probabilities
    p_value = chisquare(obs_k.numpy(), exp_k.numpy()).pvalue
    assert p_value > 1e-3, (p_value, obs_k.tolist(), exp_k.tolist())


CASES = {
    "temperature": SamplingParams(temperature=0.8, seed=None),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.2, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "penalties": SamplingParams(
        temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft_rank", [0, 3])  # a likely draft, and an unlikely one
def test_emitted_tokens_follow_target(case: str, draft_rank: int) -> None:
    params = CASES[case]
    torch.manual_seed(1234)  # the draws: a fixed sample, whatever ran before
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}-{draft_rank}".encode()))
    row0 = torch.randn(V, generator=gen) * 1.5
    row1 = torch.randn(V, generator=gen) * 1.5
    history = [3, 3, 5]  # output so far
    d0 = int(row0.argsort(descending=True)[draft_rank])
    n = 20000
    logits = torch.stack([row0, row1]).repeat(n, 1)  # [2n, V]
    drafts = torch.tensor([d0, -1]).repeat(n)
    # row 1 sees d0 in its history (penalties), as the runner builds it
    outputs = [history, history + [d0]] * n
    prompts = [PROMPT] * (2 * n)
    out = rejection_sample(
        logits, _md([params] * (2 * n), outputs, prompts), drafts, [None] * (2 * n)
    )
    tokens = out.token_ids.view(n, 2)
    accepted = out.accepted.view(n, 2)
    assert not accepted[:, 1].any()
    p0 = _target(row0, params, history)
    _chi2_ok(torch.bincount(tokens[:, 0], minlength=V), p0)
    # given the draft was kept, the bonus token follows the next row's target
    kept = accepted[:, 0]
    assert abs(kept.float().mean().item() - p0[d0].item()) < 0.02
    if kept.sum() > 500:
        p1 = _target(row1, params, history + [d0])
        _chi2_ok(torch.bincount(tokens[kept, 1], minlength=V), p1)


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen)
    drafts = torch.tensor([1, 2, -1])

    def run(extra: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        rows = torch.cat([torch.randn(extra, V), logits])
        d = torch.cat([torch.full((extra,), -1), drafts])
        ps = [SamplingParams(temperature=1.0)] * extra + [params] * 3
        out = rejection_sample(rows, _md(ps, [[]] * (extra + 3)), d, [None] * extra + [g] * 3)
        return out.token_ids[extra:].tolist() + out.accepted[extra:].tolist()

    assert run(0) == run(5) == run(2)


def test_logprobs_are_the_raw_distributions() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, logprobs=2)] * 3
    drafts = torch.tensor([int(logits[0].argmax()), int(logits[1].argmax()), -1])
    out = rejection_sample(logits, _md(params, [[]] * 3), drafts, [None] * 3)
    ref = logits.log_softmax(-1)
    for row in range(3):
        tok = int(out.token_ids[row])
        assert out.logprob_token_ids[row, 0] == tok
        torch.testing.assert_close(out.logprobs[row, 0], ref[row, tok])
        assert out.ranks[row] == 1

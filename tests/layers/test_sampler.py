"""Sampler: greedy, top-k/top-p/min-p, penalties, min_tokens, seeds, statistics, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    logprobs_to_lists,
    pad_grammar_rows,
)
from pagoda.sampling_params import SamplingParams

VOCAB = 64


def _md(params: list[SamplingParams], **kwargs) -> SamplingMetadata:
    n = len(params)
    kwargs.setdefault("prompt_token_ids", [[] for _ in range(n)])
    kwargs.setdefault("output_token_ids", [[] for _ in range(n)])
    return SamplingMetadata.from_sampling_params(params, **kwargs)


def _sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return Sampler()(logits, _md(params, **kwargs)).sampled_token_ids


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    out = _sample(logits, [SamplingParams(temperature=0)] * 6)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_1_and_tiny_top_p_equal_greedy(logits: torch.Tensor) -> None:
    torch.manual_seed(1)
    greedy = logits.argmax(dim=-1)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6), greedy)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 6), greedy)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=1.5, min_p=0.999)] * 6), greedy)


def test_mixed_greedy_and_random_rows(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)] * 3
    assert torch.equal(_sample(logits, params), logits.argmax(dim=-1))


def _frequencies(logits_row: list[float], params: SamplingParams, draws: int = 20_000):
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row]).repeat(draws, 1)  # [draws, 4]
    tokens = _sample(logits, [params] * draws)
    return torch.bincount(tokens, minlength=len(logits_row)).float() / draws


def test_temperature_sampling_follows_softmax() -> None:
    row = [1.0, 0.5, -0.5, 2.0]
    for temperature in (1.0, 0.5):
        freq = _frequencies(row, SamplingParams(temperature=temperature))
        expected = torch.softmax(torch.tensor(row) / temperature, dim=-1)
        # 20k draws: one standard deviation is at most 0.0035; allow about 4.
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def test_top_k_top_p_min_p_distributions() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log().tolist()
    # top_k=2 keeps the two best tokens, renormalized.
    freq = _frequencies(row, SamplingParams(top_k=2))
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    # top_p=0.75: the nucleus is {0.5, 0.3} (the tail 0.05 + 0.15 <= 0.25 is dropped).
    freq = _frequencies(row, SamplingParams(top_p=0.75))
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    # min_p=0.2: threshold 0.2 * 0.5 = 0.1 drops only the 0.05 token.
    freq = _frequencies(row, SamplingParams(min_p=0.2))
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3] / 0.95, atol=0.015)


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])  # [1, 5]
    prompt, output = [[0]], [[1, 2, 2]]

    def penalized(**kw) -> list[float]:
        md = _md([SamplingParams(**kw)], prompt_token_ids=prompt, output_token_ids=output)
        return apply_penalties(logits, md)[0].tolist()

    # Repetition 2: seen tokens 0 (prompt), 1, 2 (output); positive / 2, negative * 2.
    assert penalized(repetition_penalty=2.0) == pytest.approx([1.0, -2.0, 0.25, 3.0, 1.0])
    # Frequency 0.5 * count in output: token 1 once, token 2 twice; the prompt does not count.
    assert penalized(frequency_penalty=0.5) == pytest.approx([2.0, -1.5, -0.5, 3.0, 1.0])
    # Presence 0.3 once per distinct output token.
    assert penalized(presence_penalty=0.3) == pytest.approx([2.0, -1.3, 0.2, 3.0, 1.0])
    both = penalized(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    assert both == pytest.approx([1.0, -2.8, -1.05, 3.0, 1.0])


def test_penalties_change_greedy_choice_per_row() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=1.0), SamplingParams(temperature=0)]
    out = _sample(logits, params, prompt_token_ids=[[], []], output_token_ids=[[0], [0]])
    assert out.tolist() == [1, 0]  # only the penalized row moves off token 0


def test_min_tokens_masks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),  # 1 output: blocked
        SamplingParams(temperature=0, min_tokens=1),  # 1 output token already: not blocked
        SamplingParams(temperature=0, min_tokens=3),
    ]
    out = _sample(logits, params, output_token_ids=[[0], [0], []], eos_token_ids=[1, 1, 1])
    assert out.tolist() == [3, 1, 2]


def _seeded_stream(position: int, batch: int, steps: int = 5) -> list[int]:
    """Tokens of the seeded request at `position` in a batch of other random rows."""
    logits_gen = torch.Generator().manual_seed(7)
    seeded = torch.Generator().manual_seed(42)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * batch
    tokens = []
    for step in range(steps):
        torch.manual_seed(100 + step + batch)  # the unseeded rows change with the batch
        shared = torch.randn(VOCAB, generator=logits_gen)  # the seeded row's logits this step
        logits = torch.randn(batch, VOCAB)
        logits[position] = shared
        out = _sample(logits, params, generators={position: seeded})
        tokens.append(out[position].item())
    return tokens


def test_seeded_request_independent_of_batch() -> None:
    alone = _seeded_stream(position=0, batch=1)
    assert _seeded_stream(position=2, batch=4) == alone
    assert _seeded_stream(position=5, batch=8) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_of_raw_logits_and_ranks(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=1.0, logprobs=3, repetition_penalty=1.5)] * 3
    params += [SamplingParams(temperature=0, logprobs=0)] * 2 + [SamplingParams(temperature=0)]
    md = _md(params, output_token_ids=[[1, 2]] * 6)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (6, 4)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    sampled = out.sampled_token_ids.tolist()
    expected_ranks = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(sampled)]
    assert out.sampled_ranks.tolist() == expected_ranks

    rows = logprobs_to_lists(out, [p.logprobs for p in params])
    assert rows[5] is None
    ids, lps, rank = rows[3]
    assert len(ids) == len(lps) == 1 and rank == 1  # greedy without penalty: the raw argmax
    assert len(rows[0][0]) == 4
    assert math.isclose(rows[0][1][0], raw[0, rows[0][0][0]].item(), rel_tol=1e-6)


def test_no_logprobs_requested(logits: torch.Tensor) -> None:
    out = Sampler()(logits, _md([SamplingParams()] * 6))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
    assert logprobs_to_lists(out, [None] * 6) == [None] * 6


def test_allowed_token_ids_bad_words_and_grammar_bitmask_masks():
    from pagoda.layers.sampler import (
        SamplingMetadata as MD,
    )
    from pagoda.layers.sampler import (
        apply_allowed_token_ids,
        apply_bad_words,
        apply_grammar_bitmask,
    )

    logits = torch.zeros(3, 40)
    md = MD(temperature=torch.zeros(3), all_greedy=True, all_random=False)
    md.allowed_token_ids = {1: [3, 33]}
    out = apply_allowed_token_ids(logits, md)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3, 33]

    # [4] always banned; [7, 8]: 8 only right after 7; [1, 2, 3]: 3 only after 1, 2.
    md.bad_words = {0: ([[4], [7, 8], [1, 2, 3]], [5, 7]), 2: ([[1, 2, 3]], [1, 2])}
    out = apply_bad_words(logits, md)
    assert (~torch.isfinite(out)).nonzero().tolist() == [[0, 4], [0, 8], [2, 3]]

    pytest.importorskip("xgrammar")
    mask = torch.zeros(3, 2, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[0, 1] = 1 << 3  # token 35
    md.grammar_bitmask, md.grammar_rows = mask, [0]
    out = apply_grammar_bitmask(torch.zeros(3, 40), md)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2, 35]
    assert torch.isfinite(out[1:]).all()  # rows without a grammar are untouched
    # The runner pads the rows to a multiple of 16 by repeating the last: the same result
    md.grammar_rows = pad_grammar_rows([0, 2])
    assert md.grammar_rows == [0, 2] + [2] * 14
    mask[2, 0] = 1 << 4
    out = apply_grammar_bitmask(torch.zeros(3, 40), md)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2, 35]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [4]
    assert torch.isfinite(out[1]).all()

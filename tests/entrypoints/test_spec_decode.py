"""Speculative decoding (n-gram) through the whole engine, on a tiny random model.

Greedy outputs and their log-probs equal plain decoding's under prefix caching, chunked prefill
and preemption; seeded sampling is reproducible; and the distribution of sampled tokens (with
temperature, top-p, top-k and penalties) matches plain decoding's (two-sample chi-square).
Bad `speculative_config` values are one clear ValueError.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency

from pagoda import LLM, SamplingParams
from tests.helpers import save_tiny_model

# adaptive off: speculation on every step (what these tests check; test_spec_governor.py
# and `test_adaptive_*` below cover the choice)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("spec"), vocab_size=384)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for n in (9, 23, 40):
        motif = [rng.randrange(3, 384) for _ in range(rng.randrange(3, 7))]
        prompts.append((motif * 20)[:n])  # repetitive: the n-gram proposer has matches
    prompts.append([rng.randrange(3, 384) for _ in range(30)])
    return prompts


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        print_memory_report=False,
        **kw,
    )


VARIANTS = {
    "default": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
    # batches above 2 take the async loop without drafts; below, speculation resumes
    "async-batch-policy": dict(async_scheduling=True),
}
SPEC_OPTIONS = {"async-batch-policy": dict(disable_by_batch_size=2)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_plain(model_path, variant):
    prompts = _prompts()
    max_tokens = [40, 40, 11, 13]
    params = [
        SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True) for n in max_tokens
    ]
    plain = _llm(model_path, **VARIANTS[variant]).generate(prompts, params, use_tqdm=False)
    config = {**NGRAM, **SPEC_OPTIONS.get(variant, {})}
    llm = _llm(model_path, speculative_config=config, **VARIANTS[variant])
    spec = llm.generate(prompts, params, use_tqdm=False)
    accepted = 0
    for a, b, n in zip(plain, spec, max_tokens, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == n  # max_tokens, never more
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
        accepted += b.metrics.spec_num_accepted_tokens
    assert accepted > 0, "the proposer never had an accepted draft: the test checks nothing"
    m = spec[0].metrics
    assert m.spec_num_steps > 0 and 1.0 <= m.spec_mean_accepted_length <= 5.0


def test_greedy_with_logit_bias_equals_plain(model_path):
    """The verify rows apply the request's logit bias as the plain sampler does."""
    prompts = _prompts()
    bias = {t: 4.0 for t in range(3, 384, 7)} | {t: -4.0 for t in range(5, 384, 11)}
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias=bias, ignore_eos=True)
    plain = _llm(model_path).generate(prompts, params, use_tqdm=False)
    spec = _llm(model_path, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    unbiased = _llm(model_path).generate(
        prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in unbiased]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.spec_num_accepted_tokens for o in spec) > 0


def test_greedy_with_min_tokens_equals_plain(model_path):
    """A stop token is masked on a verify row until the tokens before the row (output and
    drafts) reach min_tokens, as plain decoding masks it: each prompt stops right at m tokens
    on a token its greedy output first emits there."""
    prompts = _prompts()
    free = _llm(model_path).generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    params = []
    for o in free:
        ids = o.outputs[0].token_ids
        m = next(m for m in range(12, 40) if ids[m] not in ids[:m])
        params.append(SamplingParams(temperature=0, max_tokens=40, min_tokens=m,
                                     stop_token_ids=[ids[m]]))  # fmt: skip
    plain = _llm(model_path).generate(prompts, params, use_tqdm=False)
    spec = _llm(model_path, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    for a, b, p in zip(plain, spec, params, strict=True):
        assert len(a.outputs[0].token_ids) == p.min_tokens + 1
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.metrics.spec_num_accepted_tokens for o in spec) > 0


def test_seeded_sampling_is_reproducible(model_path):
    llm = _llm(model_path, speculative_config=NGRAM)
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # alone, and in another batch: the same tokens
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
    assert alone == first[0] and again[::-1] == first


@pytest.fixture(scope="module")
def small_vocab_path(tmp_path_factory):
    # 24 tokens and a sharpened head: at temperature 1 drafts are accepted often enough (about
    # 40 %) for the test to mean something.
    path = save_tiny_model("llama", tmp_path_factory.mktemp("spec24"), vocab_size=24)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 4
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_tokens_follow_plain_distribution(small_vocab_path, proposer):
    """The first 4 tokens of many samples of one prompt, speculative vs plain (2-sample
    chi-square per position), with temperature, top-k, top-p and all three penalties: the
    target's distribution at each verified position must see the drafts before it. The prompt
    is the model's own greedy continuation, so the n-gram proposer finds likely drafts; the
    draft model is the target itself (its greedy drafts: the likeliest tokens)."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [5, 9, 11]
    prompt += (
        _llm(small_vocab_path).generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    n = 300
    params = SamplingParams(
        temperature=1.0,
        top_k=12,
        top_p=0.95,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        repetition_penalty=1.1,
        max_tokens=4,
        ignore_eos=True,
    )
    outs = {}
    # 300 requests at once: speculate at every batch size (the default stops above 8)
    config = NGRAM
    if proposer == "draft_model":
        config = {"model": str(small_vocab_path), "num_speculative_tokens": 4}
    always = {**config, "disable_by_batch_size": None}
    for name, kw in (("plain", {}), ("spec", dict(speculative_config=always))):
        llm = _llm(small_vocab_path, max_num_seqs=128, seed=3, **kw)
        res = llm.generate([prompt] * n, params, use_tqdm=False)
        outs[name] = torch.tensor([r.outputs[0].token_ids for r in res])  # [n, 4]
        if name == "spec":
            assert sum(r.metrics.spec_num_accepted_tokens for r in res) > n // 10
    for pos in range(4):
        a = torch.bincount(outs["plain"][:, pos], minlength=24)
        b = torch.bincount(outs["spec"][:, pos], minlength=24)
        table = torch.stack([a, b])
        table = table[:, table.sum(0) > 0]
        # pool rare tokens into one column (expected counts >= 5 for the approximation)
        rare = table.sum(0) < 10
        if rare.any():
            table = torch.cat([table[:, ~rare], table[:, rare].sum(1, keepdim=True)], dim=1)
        p_value = chi2_contingency(table.numpy()).pvalue
        assert p_value > 1e-3, (pos, p_value, table.tolist())


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 4, "bogus": 1}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_config_is_one_clear_error(model_path, config, match):
    with pytest.raises(ValueError, match=match):
        _llm(model_path, speculative_config=config)


def test_padded_drafts_equal_plain(model_path):
    """Verify graphs need k drafts per sequence: short proposals are padded with -1 (never
    accepted). The padding is exercised here on the CPU by turning it on without graphs."""
    prompts = _prompts()  # the last one random: no n-gram match, all padding
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
        for n in (30, 30, 11, 13)  # max_tokens cuts drafts of the shorter ones
    ]
    plain = _llm(model_path).generate(prompts, params, use_tqdm=False)
    llm = _llm(model_path, speculative_config=NGRAM)
    core = llm.llm_engine.core
    core.pad_drafts = True
    shapes = []  # query lengths of each step that verifies drafts
    launch = core.runner.launch

    def record(sched):
        if any(r.spec_token_ids for r in sched.scheduled):
            shapes.append([r.num_new_tokens for r in sched.scheduled])
        return launch(sched)

    core.runner.launch = record
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    # every sequence of a verify step has 1 + k tokens (what a verify graph replays), also
    # those left without a real draft (no match, or max_tokens reached)
    assert shapes and all(s == [5] * len(s) for s in shapes), shapes
    m = [o.metrics for o in spec]
    assert sum(x.spec_num_accepted_tokens for x in m) > 0
    # padding is not counted as proposed drafts
    assert sum(x.spec_num_draft_tokens for x in m) < 4 * sum(x.spec_num_steps for x in m)


@pytest.mark.gpu
def test_gpu_verify_graphs_equal_plain(model_path):
    """On CUDA the verify steps replay graphs of query length 1 + k: same tokens as plain."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32")
    plain = LLM(str(model_path), skip_tokenizer_init=True, max_model_len=256, **kw)
    ref = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    llm = LLM(
        str(model_path),
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config=NGRAM,
        **kw,
    )
    assert llm.llm_engine.core.runner.verify_graph_runner is not None
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.metrics.spec_num_accepted_tokens for o in spec) > 0
    llm.shutdown()


class _ScriptedProposer:
    """Proposes the next `k` tokens of a known continuation, or tokens that never match."""

    def __init__(self, k: int, reference: dict[tuple, list[int]], right: bool):
        self.k, self.reference, self.right = k, reference, right

    def propose(self, token_ids, k=None, state=None) -> list[int]:
        for prompt, cont in self.reference.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = cont[done : done + self.k]
                return drafts if self.right else [(t + 1) % 384 for t in drafts]
        return []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("right", [True, False])
def test_adaptive_shadow_proposals_measure_acceptance(
    model_path, monkeypatch, right, async_scheduling
):
    """While the governor keeps plain decoding (forced here), the n-gram proposer still
    proposes in the shadow and the governor learns the tokens a speculating step would emit:
    k + 1 = 5 where every draft is right (all but the proposals that reach past the end), 1
    where none is. The output is plain decoding's."""
    from pagoda.engine.spec_governor import SpecGovernor

    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _llm(model_path).generate(prompts, params, use_tqdm=False)
    llm = _llm(
        model_path,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        async_scheduling=async_scheduling,
    )
    core = llm.llm_engine.core
    assert isinstance(core.governor, SpecGovernor) and core.governor.shadows  # n-gram: host-side
    monkeypatch.setattr(core.governor, "choose", lambda batch: False)
    reference = {tuple(p): r.outputs[0].token_ids for p, r in zip(prompts, ref, strict=True)}
    core.proposer = _ScriptedProposer(4, reference, right)
    out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, out, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.metrics.spec_num_steps for o in out) == 0  # nothing speculated
    gov = core.governor
    assert gov.token_samples > 20
    if right:
        assert gov.tokens_per_seq > 4.0
    else:
        assert gov.tokens_per_seq == pytest.approx(1.0)

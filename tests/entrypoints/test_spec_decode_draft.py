"""Speculative decoding with a draft model, through the whole engine, on tiny random models.

The draft shares the target's blocks (its own KV cache) and follows every step: greedy output
equals plain decoding's under prefix caching, chunked prefill and preemption, for a draft that
is the target itself (every draft accepted) and for unrelated drafts (bf16-shaped and W4A16:
rejections). Seeded sampling is reproducible, no block leaks, an incompatible draft is one
ValueError naming both models, and `--speculative-config` reaches the engine. On a GPU the
target's graphs run beside the eager draft.
"""

from __future__ import annotations

import argparse
import json
import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.args import EngineArgs
from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs, merge_model_option
from tests.entrypoints.test_spec_decode import _llm
from tests.helpers import save_tiny_model, tiny_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = save_tiny_model("llama", root / "target", vocab_size=384)
    other = save_tiny_model("llama", root / "other", seed=1, vocab_size=384, num_hidden_layers=1)
    # hidden 128: the W4A16 dummy layout's group size (128) divides every layer
    quant_dir = root / "w4a16"
    quant_dir.mkdir()
    tiny_config("llama", vocab_size=384, hidden_size=128, intermediate_size=256).to_json_file(
        quant_dir / "config.json"
    )
    return {
        "self": str(target),
        "other": str(other),
        "w4a16": f"config:{quant_dir / 'config.json'}:w4a16",
    }


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (9, 23, 40, 5)]


def _spec(draft: str, k: int = 3, **kw) -> dict:
    return {"model": draft, "num_speculative_tokens": k, "adaptive": False, **kw}


VARIANTS = {
    "default": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
}


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_plain(models, draft, variant):
    prompts = _prompts()
    max_tokens = [24, 24, 11, 13]
    params = [
        SamplingParams(temperature=0, max_tokens=n, logprobs=1, ignore_eos=True) for n in max_tokens
    ]
    plain = _llm(models["self"], **VARIANTS[variant]).generate(prompts, params, use_tqdm=False)
    llm = _llm(models["self"], speculative_config=_spec(models[draft]), **VARIANTS[variant])
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b, n in zip(plain, spec, max_tokens, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == n  # max_tokens, never more
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for t in la:
                assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
    drafted = sum(o.metrics.spec_num_draft_tokens for o in spec)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in spec)
    assert drafted > 0
    if draft == "self":  # the target's own greedy tokens: all accepted
        assert accepted == drafted
    else:  # unrelated random weights: rejections happen
        assert accepted < drafted
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.memory_report.num_blocks


def test_quantized_draft(models):
    """A W4A16 draft (random weights of another shape, same vocabulary) under a bf16-layout
    target: loads, proposes, and changes nothing in the output."""
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _llm(models["self"]).generate(prompts, params, use_tqdm=False)
    llm = _llm(models["self"], speculative_config=_spec(models["w4a16"]))
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.metrics.spec_num_draft_tokens for o in spec) > 0
    quantized = llm.llm_engine.core.runner.draft.model_config.quantization
    assert quantized is not None and quantized["format"] == "pack-quantized"


def test_seeded_sampling_is_reproducible(models):
    llm = _llm(models["self"], speculative_config=_spec(models["other"]))
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
    assert alone == first[0] and again[::-1] == first
    other = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=12, ignore_eos=True)
    assert llm.generate(prompts[:1], other, use_tqdm=False)[0].outputs[0].token_ids != first[0]


def test_no_block_leak_over_many_requests(models):
    """48 requests of mixed lengths, temperatures and max_tokens through a small pool (with
    preemption and the draft's lookahead slots): every block comes back."""
    llm = _llm(
        models["self"],
        max_num_seqs=8,
        num_gpu_blocks_override=40,
        max_model_len=128,
        speculative_config=_spec(models["other"], 4, disable_by_batch_size=None),
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(2, 60))] for _ in range(48)]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 12), seed=i)
        for i in range(48)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) > 0
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.memory_report.num_blocks
    assert not core.scheduler.requests


def test_incompatible_draft_is_one_clear_error(models, tmp_path):
    vocab = save_tiny_model("llama", tmp_path / "vocab", vocab_size=512)
    with pytest.raises(ValueError, match=r"vocab_size 512 \(draft\) > 384 \(target\)") as e:
        EngineArgs(model=models["self"], speculative_config=_spec(str(vocab))).create_configs()
    assert str(vocab) in str(e.value) and models["self"] in str(e.value)
    eos = save_tiny_model("llama", tmp_path / "eos", vocab_size=384, eos_token_id=7)
    with pytest.raises(ValueError, match=r"eos_token_id \[7\] \(draft\) vs \[2\] \(target\)"):
        EngineArgs(model=models["self"], speculative_config=_spec(str(eos))).create_configs()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(
            model=models["self"], speculative_config=_spec(models["other"]), tensor_parallel_size=2
        ).create_configs()


def test_draft_with_a_smaller_vocabulary(models, tmp_path):
    # A target with padded embeddings (400 ids) and a draft of 384: the prompt's ids past the
    # draft's table reach it clamped; the output is the target's own.
    target = save_tiny_model("llama", tmp_path / "padded", vocab_size=400)
    prompts = [[390, 399, *p] for p in _prompts()]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _llm(target).generate(prompts, greedy, use_tqdm=False)
    spec = _llm(target, speculative_config=_spec(models["other"])).generate(
        prompts, greedy, use_tqdm=False
    )
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert sum(o.metrics.spec_num_draft_tokens for o in spec) > 0


def test_cli_json_reaches_the_engine(models):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = json.dumps(_spec(models["other"], 2))
    ns = parser.parse_args([models["self"], "--speculative-config", config])
    merge_model_option(ns)
    *_, scheduler, runner = EngineArgs(**engine_kwargs(ns)).create_configs()
    assert scheduler.speculative.method == "draft_model"
    assert scheduler.speculative.num_speculative_tokens == 2
    assert runner.draft_model.model == models["other"]


@pytest.mark.gpu
def test_gpu_draft_equals_plain(models):
    """On CUDA: target and draft replay graphs (decode, verify, the draft's proposing steps);
    same tokens as plain decoding, and the draft's graphs did run."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    plain = LLM(models["self"], **kw)
    ref = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    llm = LLM(models["self"], speculative_config=_spec(models["other"]), **kw)
    draft = llm.llm_engine.core.runner.draft
    assert sorted(draft.graphs) == [1, 1 + 3]  # k = 3
    replays = {q: 0 for q in draft.graphs}
    for q, runner in draft.graphs.items():
        run = runner.run

        def counted(*a, q=q, run=run, **k):
            replays[q] += 1
            return run(*a, **k)

        runner.run = counted
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.metrics.spec_num_draft_tokens for o in spec) > 0
    assert replays[1] > 0 and replays[4] > 0, replays
    llm.shutdown()

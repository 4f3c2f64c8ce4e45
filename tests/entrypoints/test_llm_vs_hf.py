"""Acceptance: greedy outputs of the whole engine equal transformers' `generate`.

Tiny random Llama / Qwen2 / Qwen3 models, a batch of prompts of different lengths, with prefix
caching on and off, chunked prefill forced by a small token budget, and preemption forced by a
tiny KV cache. Logprobs returned by the engine match transformers' log-softmax.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import hf_greedy, save_tiny_model

MAX_NEW = 12


def _prompts(seed: int, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 17, 33, 40]
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    # two prompts share a 20-token prefix (16 = one full block) to exercise prefix hits
    prompts.append(shared + [rng.randrange(3, vocab) for _ in range(7)])
    prompts.append(shared + [rng.randrange(3, vocab) for _ in range(11)])
    return prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_and_reference(request, tmp_path_factory):
    arch = request.param
    path = save_tiny_model(arch, tmp_path_factory.mktemp(arch))
    prompts = _prompts(hash(arch) % 1000)
    tokens, logprobs = hf_greedy(path, prompts, MAX_NEW)
    return arch, path, prompts, tokens, logprobs


ENGINE_VARIANTS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    # 9 blocks of 16 tokens (8 usable) cannot hold six 30–50 token sequences at once
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
    # Async scheduling (the CUDA default): step N+1 is scheduled before step N's tokens reach
    # the host, its last input taken from the device. Same tokens in every case.
    "async": dict(async_scheduling=True),
    "async-chunked-prefill": dict(async_scheduling=True, max_num_batched_tokens=16),
    "async-preemption": dict(async_scheduling=True, num_gpu_blocks_override=9, max_model_len=128),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(model_and_reference, variant):
    arch, path, prompts, ref_tokens, ref_logprobs = model_and_reference
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        print_memory_report=False,
        **{"max_model_len": 256, **ENGINE_VARIANTS[variant]},
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens[i], f"{arch}/{variant} prompt {i}"
        assert comp.finish_reason == "length"
        # logprobs of the sampled token and of the top alternatives match transformers'
        for step, entry in enumerate(comp.logprobs):
            ref = ref_logprobs[i][step]
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[tid].item()) < 1e-3, (arch, variant, i, step)
    if variant.endswith("preemption"):
        assert llm.memory_report().num_blocks == 8
        assert llm.llm_engine.core.num_preemptions > 0
    if variant in ("default", "async"):
        # the two prompts sharing 20 tokens: the second one reused the first full block
        assert max(o.num_cached_tokens for o in outs[4:]) == 16


def test_engine_logits_match_hf_closely(tmp_path):
    """Beyond greedy ids: the full next-token distribution at the first step matches."""
    path = save_tiny_model("qwen2", tmp_path)
    prompt = list(range(3, 40))
    _, ref = hf_greedy(path, [prompt], 1)
    llm = LLM(
        str(path),
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=128,
        print_memory_report=False,
    )
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False
    )[0]
    entry = out.outputs[0].logprobs[0]
    got = torch.tensor([lp.logprob for lp in entry.values()])
    want = ref[0][0][list(entry.keys())]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

"""The paged KV cache is allocated without a zero fill: only the null block is zeroed.

What makes that safe is that attention never reads a slot it has not written first. The tests
fill every other block with NaN right after start-up (the worst garbage an unfilled allocation
can hold) and require the same greedy tokens and log-probs as a zero-filled cache, through
prefix-cache hits, chunked prefill, preemption (blocks freed and reused) and decode.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import save_tiny_model


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 384) for _ in range(35)]  # two full blocks: prefix-cache hits
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (20, 33, 47)]
    prompts += [shared + [rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 14)]
    return prompts


VARIANTS = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
}


def _run(path, device: str, fill: float, variant: str):
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(str(path), dtype=dtype, device=device, skip_tokenizer_init=True,
              print_memory_report=False, **{"max_model_len": 256, **VARIANTS[variant]})  # fmt: skip
    caches = llm.llm_engine.core.runner.kv_caches
    for cache in caches:  # [2, num_blocks, block_size, Hkv, D]
        assert torch.count_nonzero(cache[:, 0]) == 0, "the null block must hold zeros"
        cache[:, 1:].fill_(fill)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    # Twice: the second pass hits the prefix cache of the first one's blocks.
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs += llm.generate(prompts, params, use_tqdm=False)
    preemptions = llm.llm_engine.core.num_preemptions
    llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs] for o in outs
    ]
    return tokens, logprobs, preemptions


def _check(tmp_path, device: str, variant: str) -> None:
    path = save_tiny_model("llama", tmp_path / "m")
    ref_tokens, ref_logprobs, _ = _run(path, device, 0.0, variant)
    tokens, logprobs, preemptions = _run(path, device, float("nan"), variant)
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # bit for bit: no NaN slot was read, even times zero
    assert tokens[: len(tokens) // 2] == tokens[len(tokens) // 2 :]
    if variant == "preemption":
        assert preemptions > 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unwritten_slots_are_never_read_cpu(tmp_path, variant):
    _check(tmp_path, "cpu", variant)


@pytest.mark.gpu  # Triton kernels, CUDA graphs (padding rows read the null block)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unwritten_slots_are_never_read_cuda(tmp_path, variant):
    _check(tmp_path, "cuda", variant)

"""LLM.shutdown() and `with LLM(...)`: every allocation of the engine is released, so that a
second engine starts in the same process; the first one refuses work afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import save_tiny_model

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("shut") / "m")


def _llm(path, **kw):
    return LLM(
        str(path), skip_tokenizer_init=True, max_model_len=64, print_memory_report=False, **kw
    )


def test_shutdown_frees_the_model_and_cache(tiny):
    llm = _llm(tiny)
    first = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.core.runner
    model = weakref.ref(runner.model)
    cache = weakref.ref(runner.kv_caches[0])
    workspace = weakref.ref(runner.split_k_workspace)
    llm.shutdown()
    gc.collect()
    # nothing else kept them alive
    assert model() is None and cache() is None and workspace() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent
    with _llm(tiny) as again:  # a second engine in the same process gives the same answer
        assert again.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert again.llm_engine.core.runner.model is None  # the context manager shut it down


@pytest.mark.gpu
def test_gpu_memory_returns_and_second_engine_gets_the_same_cache(tiny):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with _llm(tiny, device="cuda", gpu_memory_utilization=0.5) as llm:
        llm.generate([[5, 6, 7]] * 3, GREEDY, use_tqdm=False)
        kv_alone = llm.memory_report().kv_cache_bytes
        assert llm.memory_report().cuda_graph_sizes  # graphs were captured (Triton present)
    # Everything is back (cuBLAS's workspaces included: shutdown clears them).
    assert torch.cuda.memory_allocated() - before < 16 << 20
    with _llm(tiny, device="cuda", gpu_memory_utilization=0.5) as second:
        assert abs(second.memory_report().kv_cache_bytes - kv_alone) <= 0.05 * kv_alone

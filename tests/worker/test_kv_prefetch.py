"""The KV prefetch of the fused decode attention (its first cache blocks into the L2 before it
waits, sm_90, kernel name "kv_prefetch") changes no token or logprob on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import save_tiny_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_engine_kv_prefetch_changes_no_token(tmp_path, monkeypatch):
    """Greedy tokens and logprobs are identical with `kv_prefetch` (on by default, sm_90)
    disabled, at batch 1 and 2."""
    from pagoda import LLM, SamplingParams
    from pagoda.layers import attention

    path = save_tiny_model(
        "qwen2", tmp_path / "m", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
        num_key_value_heads=2, num_hidden_layers=4, vocab_size=1024,
    )  # fmt: skip
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 200))]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def run():
        with LLM(
            str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512,
            print_memory_report=False,
        ) as llm:  # fmt: skip
            outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]  # batch 1
            outs += llm.generate(prompts, greedy, use_tqdm=False)  # batch 2
            return outs

    outs = run()
    monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "kv_prefetch")
    attention._kv_prefetch.cache_clear()  # read once per process
    try:
        assert not attention._kv_prefetch()
        off_outs = run()
    finally:
        attention._kv_prefetch.cache_clear()
    for a, b in zip(outs, off_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs

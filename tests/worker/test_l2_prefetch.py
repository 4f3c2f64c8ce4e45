"""The L2 prefetch plans: which weight bytes each layer's decode attention streams, in which
order, cut where; bound by the runner on sm_90+ only, and changing no output on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.models.qwen2 import Qwen2ForCausalLM
from pagoda.worker.l2_prefetch import (
    PrefetchPlan,
    bind_l2_prefetch,
    byte_ranges,
    default_budget,
    linear_tensors,
)
from pagoda.worker.offload import decoder_layers
from tests.helpers import save_tiny_model, tiny_config


def test_byte_ranges_align_merge_and_cut():
    base = torch.empty(8192, dtype=torch.uint8)
    p = base.data_ptr()
    assert p % 16 == 0
    a, b, c = base[:1024], base[1024:2048], base[4096:5120]
    assert byte_ranges([a, b, c], 1 << 20) == [(p, 2048), (p + 4096, 1024)]  # a, b touch
    # in the order given, not by address
    assert byte_ranges([c, a], 1 << 20) == [(p + 4096, 1024), (p, 1024)]
    # the budget cuts the last range to a 16-byte multiple and stops there
    assert byte_ranges([a, b, c], 1500) == [(p, 1488)]
    assert byte_ranges([a, c], 1024 + 40) == [(p, 1024), (p + 4096, 32)]
    # unaligned ends shrink to the 16-byte grid inside the tensor; an empty or sub-16-byte
    # remainder, a non-contiguous view and an empty tensor are skipped
    assert byte_ranges([base[1:33]], 1 << 20) == [(p + 16, 16)]
    assert byte_ranges([base[1:20]], 1 << 20) == []
    grid = base[:4096].view(64, 64)
    assert byte_ranges([grid[:, :32], base[:0], base[6144:6160]], 1 << 20) == [(p + 6144, 16)]
    assert byte_ranges([a], 0) == []


def test_linear_tensors_smallest_first():
    lin = nn.Linear(64, 32, bias=True)
    assert [t.shape for t in linear_tensors(lin)] == [(32,), (32, 64)]
    lin.register_buffer("scales", torch.zeros(4, 32))
    assert [t.shape for t in linear_tensors(lin)] == [(32,), (4, 32), (32, 64)]


def _model(num_layers: int = 3) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    with torch.device("cpu"):
        return Qwen2ForCausalLM(tiny_config("qwen2", num_hidden_layers=num_layers))


def _after(layers, i):
    layer = layers[i]
    order = [layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return order + ([layers[i + 1].self_attn.qkv_proj] if i + 1 < len(layers) else [])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_bind_plans_cover_the_weights_read_after_attention():
    """Layer i: o_proj, gate_up, down, then layer i + 1's qkv (its bias first), each linear's
    tensors smallest first; the last layer has no next qkv."""
    layers = decoder_layers(_model())
    total = bind_l2_prefetch(layers, 1 << 30, max_tokens=8)
    want_total = 0
    for i, layer in enumerate(layers):
        plan = layer.self_attn.attn.l2_prefetch
        assert isinstance(plan, PrefetchPlan) and plan.max_tokens == 8
        tensors = [t for lin in _after(layers, i) for t in linear_tensors(lin)]
        if i + 1 < len(layers):
            qkv = layers[i + 1].self_attn.qkv_proj
            ptrs = [t.data_ptr() for t in tensors[-2:]]  # Qwen2: qkv has a bias
            assert ptrs == [qkv.bias.data_ptr(), qkv.weight.data_ptr()]
        assert plan.ranges.dtype == torch.int64 and plan.ranges.shape[1] == 2
        assert plan.ranges.tolist() == [list(r) for r in byte_ranges(tensors, 1 << 40)]
        assert plan.nbytes == sum(_nbytes(t) for t in tensors)  # every size a 16-byte multiple
        want_total += plan.nbytes
        assert plan.for_tokens(8) is plan.ranges and plan.for_tokens(9) is None
    assert total == want_total
    last = layers[-1].self_attn.attn.l2_prefetch
    mlp = layers[-1].mlp
    assert last.nbytes == sum(
        _nbytes(t)
        for lin in (layers[-1].self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for t in linear_tensors(lin)
    )


def test_bind_cuts_each_plan_at_the_budget():
    layers = decoder_layers(_model())
    o = layers[0].self_attn.o_proj.weight
    budget = _nbytes(o) + 1000  # o_proj whole, then a prefix of gate_up's weight
    total = bind_l2_prefetch(layers, budget)
    for layer in layers:
        plan = layer.self_attn.attn.l2_prefetch
        assert plan.nbytes == budget // 16 * 16
        first, second = plan.ranges.tolist()[:2]
        assert first == [layer.self_attn.o_proj.weight.data_ptr(), _nbytes(o)]
        assert second == [layer.mlp.gate_up_proj.weight.data_ptr(), 992]
    assert total == len(layers) * (budget // 16 * 16)
    assert bind_l2_prefetch(layers, 0) == 0
    assert all(layer.self_attn.attn.l2_prefetch is None for layer in layers)


def test_size_order_puts_the_smallest_linear_first():
    layers = decoder_layers(_model())
    bind_l2_prefetch(layers, 1 << 30, order="size")
    plan = layers[0].self_attn.attn.l2_prefetch
    lins = _after(layers, 0)
    by_size = sorted(lins, key=lambda lin: sum(_nbytes(t) for t in linear_tensors(lin)))
    assert by_size[0] is not lins[0] or by_size[1] is not lins[1]  # a different order here
    tensors = [t for lin in by_size for t in linear_tensors(lin)]
    assert plan.ranges.tolist() == [list(r) for r in byte_ranges(tensors, 1 << 40)]
    with pytest.raises(ValueError, match="order"):
        bind_l2_prefetch(layers, 1 << 30, order="random")


def test_no_budget_off_hopper():
    assert default_budget(torch.device("cpu")) == 0


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_engine_prefetches_on_hopper_and_changes_no_token(tmp_path, monkeypatch):
    """No weight-prefetch plan is bound by default (measured slower, session 18), and greedy
    tokens and logprobs are identical with `kv_prefetch` (on by default, sm_90) disabled."""
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
            runner = llm.llm_engine.core.runner
            plans = [layer.self_attn.attn.l2_prefetch for layer in decoder_layers(runner.model)]
            outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]  # batch 1
            outs += llm.generate(prompts, greedy, use_tqdm=False)  # batch 2
            return runner.l2_prefetch_bytes, plans, outs

    nbytes, plans, outs = run()
    # session 18 measured the weight prefetch slower: no plan is bound by default
    assert nbytes == 0 and all(p is None for p in plans)
    monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "l2_prefetch,kv_prefetch")
    attention._kv_prefetch.cache_clear()  # read once per process
    try:
        assert not attention._kv_prefetch()
        off_bytes, off_plans, off_outs = run()
    finally:
        attention._kv_prefetch.cache_clear()
    assert off_bytes == 0 and all(p is None for p in off_plans)
    for a, b in zip(outs, off_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs

"""The tensor-core W4A16 GEMV (`triton_w4a16_mma`): repacking, the fragment-level emulator, the
kernel's bookkeeping under the Triton interpreter (which runs the same tile product without PTX),
and on the GPU the real `mma.sync` path against `wna16_linear_ref`."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import triton_w4a16_mma as mm
from pagoda.kernels.wna16 import dequantize_weight, wna16_linear_ref


def _case(m, n, k, group, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gs = k if group <= 0 else group
    q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    words = mm.repack_mma(q.to(torch.int32) + 8)
    pairs = mm.repack_mma_scales(scale.t().contiguous())
    ref = wna16_linear_ref(x.float(), q, scale.float(), None, gs)
    return x.to(device), words.to(device), pairs.to(device), ref, q, scale


def test_repack_round_trips_and_rejects_bad_shapes() -> None:
    g = torch.Generator().manual_seed(1)
    u = torch.randint(0, 16, (48, 192), generator=g)
    words = mm.repack_mma(u)
    assert words.dtype == torch.int32 and words.numel() == 48 * 192 // 8
    assert torch.equal(mm.unpack_mma(words, 48, 192).long(), u)
    scales = torch.rand(3, 48, generator=g).to(torch.bfloat16)
    pairs = mm.repack_mma_scales(scales)
    assert pairs.shape == (3, 3, 8) and pairs.dtype == torch.int32
    assert torch.equal(mm.unpack_mma_scales(pairs), scales)
    with pytest.raises(ValueError, match="N % 16"):
        mm.repack_mma(torch.zeros(40, 128, dtype=torch.int32))
    assert not mm.mma_supported(48, 192, 32, 4, False)  # group not a multiple of 64
    assert not mm.mma_supported(48, 192, 64, 4, True)  # zero points
    assert not mm.mma_supported(48, 192, 64, 8, False)
    assert mm.mma_supported(48, 192, 64, 4, False) and mm.mma_supported(48, 192, -1, 4, False)


def test_fragment_emulator_matches_the_dequantized_matmul() -> None:
    """The PTX m16n8k16 fragment rules applied to the repacked words give x @ W^T."""
    x, words, _, ref, _, scale = _case(5, 32, 256, 128)
    out = mm.mma_gemv_emulate(x, words, scale.t().contiguous(), 32, 128)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


# (M, N, K, group, (K tiles per step, split, warps), bias): odd step counts (the ping-pong's
# lone last step), split-K with the serial reduction, M past one block of 8 rows, per-channel.
CASES = [
    (1, 32, 128, 64, (2, 1, 1), False),
    (3, 48, 576, 64, (1, 3, 1), True),
    (12, 16, 256, -1, (2, 1, 2), False),
    (20, 32, 512, 128, (2, 2, 1), True),
]


@pytest.mark.parametrize("m,n,k,group,config,bias", CASES)
def test_mma_gemv_interpreter(m, n, k, group, config, bias) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, group)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    y = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # one bf16 ulp of the largest output (the interpreter's fp32 -> bf16 cast truncates)
    tol = 2.0**-7 * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol


def test_mma_gemv_reuses_its_workspace_between_calls() -> None:
    """Split-K leaves the shared workspace and counters zeroed: a second call is identical."""
    x, words, pairs, ref, _, _ = _case(2, 32, 512, 128, seed=3)
    a = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 4, 1))
    b = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 4, 1))
    assert torch.equal(a, b)
    assert (a.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_mma_gemv_rejects_bad_input() -> None:
    x, words, pairs, *_ = _case(1, 32, 128, 64)
    with pytest.raises(ValueError, match="M <= 64"):
        mm.wna16_mma_gemv(x.repeat(65, 1), words, pairs, 32, 64)
    with pytest.raises(ValueError, match="bf16"):
        mm.wna16_mma_gemv(x.float(), words, pairs, 32, 64)
    with pytest.raises(ValueError, match="unsupported shape"):
        mm.wna16_mma_gemv(x, words, pairs, 32, 32)
    with pytest.raises(ValueError, match="bias"):
        mm.wna16_mma_gemv(x, words, pairs, 32, 64, bias=torch.zeros(31, dtype=torch.bfloat16))


@pytest.mark.parametrize("group", [64, -1])
def test_mma_dequant_interpreter(group) -> None:
    _, words, pairs, _, q, scale = _case(1, 48, 576, group)
    w = mm.wna16_mma_dequant(words, pairs, 48, 576, group)
    ref = dequantize_weight(q, scale.float(), None, 576 if group <= 0 else group, None)
    rel = (w.float() - ref).abs() / ref.abs().clamp_min(1e-9)
    assert rel.max().item() <= 2.0**-7  # truncating cast in the interpreter; exact on the GPU


def test_prefetch_setting_parses_and_rejects_bad_values(monkeypatch) -> None:
    assert mm.parse_prefetch("0") == (0, False)
    assert mm.parse_prefetch("8") == (8, False)
    assert mm.parse_prefetch(" 4 , loop") == (4, True)
    assert mm.parse_prefetch("all")[0] >= 1 << 20
    for bad in ("-1", "x", "4,loops", "0,loop", "4,loop,1", ""):
        with pytest.raises(ValueError, match="PAGODA_W4A16_PF"):
            mm.parse_prefetch(bad)
    monkeypatch.delenv("PAGODA_W4A16_PF", raising=False)
    assert mm.default_mma_prefetch(1, 37888, 3584, (8, 9)) == (0, False)  # no bulk prefetch
    assert mm.default_mma_prefetch(1, 37888, 3584, (9, 0)) == (0, False)  # measured slower
    monkeypatch.setenv("PAGODA_W4A16_PF", "3,loop")
    assert mm.default_mma_prefetch(1, 37888, 3584, (9, 0)) == (3, True)
    assert mm.default_mma_prefetch(1, 37888, 3584, (8, 0)) == (0, False)


@pytest.mark.parametrize("prefetch", [(0, False), (2, True), (1 << 20, False)])
def test_mma_gemv_prefetch_settings_interpreter(prefetch) -> None:
    """The prefetch is a hint (skipped by the interpreter, which has no PTX): every setting
    compiles into the same bookkeeping and gives the same result, split-K included."""
    x, words, pairs, ref, _, _ = _case(2, 32, 1024, 128, seed=4)
    y = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 3, 1), prefetch=prefetch)
    base = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 3, 1), prefetch=(0, False))
    assert torch.equal(y, base)
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_pdl_early_trigger_arguments(monkeypatch) -> None:
    from pagoda.kernels import pdl

    cpu = torch.zeros(1)
    assert pdl.pdl_launch_args(cpu) == {"USE_PDL": False}
    assert pdl.pdl_launch_args(cpu, early=True) == {"USE_PDL": False, "PDL_EARLY": False}
    monkeypatch.setattr(pdl, "pdl_enabled", lambda t: True)
    pdl._early_enabled.cache_clear()
    monkeypatch.setenv("PAGODA_PDL_EARLY", "0")
    assert pdl.pdl_launch_args(cpu, early=True)["PDL_EARLY"] is False
    pdl._early_enabled.cache_clear()
    monkeypatch.setenv("PAGODA_PDL_EARLY", "1")
    assert pdl.pdl_launch_args(cpu, early=True) == {
        "USE_PDL": True, "launch_pdl": True, "PDL_EARLY": True
    }  # fmt: skip
    pdl._early_enabled.cache_clear()


def test_default_config_follows_the_shape() -> None:
    assert mm.default_mma_config(1, 37888, 3584) == (2, 1, 1)  # 2,368 column groups
    kt, split, warps = mm.default_mma_config(1, 3584, 18944)
    assert split > 1 and warps == 2
    assert mm.default_mma_config(16, 4608, 3584) == (4, 2, 2)
    assert mm._k_tiles_per_step(576, 4) == 1 and mm._k_tiles_per_step(3584, 4) == 4


def test_layer_mma_backend_on_cpu_interpreter(monkeypatch) -> None:
    """The layer's tensor-core path (`_apply_mma`, `_dequantize`), run by the interpreter:
    the layout is chosen on CUDA only, so the test moves a processed layer into it by hand."""
    from pagoda.kernels.wna16 import pack_to_int32
    from pagoda.layers import quantized_linear as ql
    from pagoda.layers.linear import ReplicatedLinear

    inp, out = 256, 32
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    scale = (torch.rand(out, inp // 64, generator=g) * 0.02 + 0.001).bfloat16()
    method = ql.WNA16LinearMethod(ql.WeightQuantArgs(4, True, 64))
    layer = ReplicatedLinear(inp, out, bias=True, linear_method=method, dtype=torch.bfloat16)
    layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.normal_()
    assert not ql._use_mma_layout(4, True, torch.bfloat16, out, inp, 64, torch.device("cpu"))
    method.process_weights_after_loading(layer)
    assert layer.wna16_backend == "dequant"
    for name in ("codes", "scales"):
        delattr(layer, name)
    layer.mma_words = torch.nn.Parameter(mm.repack_mma(q.to(torch.int32) + 8), False)
    layer.mma_scales = torch.nn.Parameter(mm.repack_mma_scales(scale.t().contiguous()), False)
    layer.wna16_backend = "mma"
    expect = dequantize_weight(q, scale, None, 64, None, torch.bfloat16)
    assert torch.equal(method.dequantized_weight(layer), expect)
    x = torch.randn(20, inp, generator=g).bfloat16()
    ref = wna16_linear_ref(x.float(), q, scale.float(), None, 64, bias=layer.bias.float())
    tol = 2.0**-6 * ref.abs().max().item()
    monkeypatch.setenv("PAGODA_W4A16_MMA_MAX_M", "16")
    monkeypatch.setenv("PAGODA_W4A16_MMA_GEMM_MAX_M", "18")
    for m in (1, 9, 16, 17, 20):  # GEMV (1 and 2 blocks of 8 rows), GEMM, dequant + matmul
        assert (layer(x[:m]).float() - ref[:m]).abs().max().item() <= tol
    monkeypatch.delenv("PAGODA_W4A16_MMA_GEMM_MAX_M")
    monkeypatch.setenv("PAGODA_W4A16_MMA_MAX_M", "many")
    with pytest.raises(ValueError, match="PAGODA_W4A16_MMA_MAX_M"):
        layer(x[:1])
    monkeypatch.setenv("PAGODA_W4A16_MMA", "0")
    assert not ql._use_mma_layout(4, True, torch.bfloat16, out, inp, 64, torch.device("cuda"))
    monkeypatch.delenv("PAGODA_W4A16_MMA_MAX_M")
    assert ql._mma_max_m(4608, 3584) == 32 and ql._mma_max_m(37888, 3584) == 32
    assert ql._mma_gemm_max_m(4608, 3584) == 0 and ql._mma_gemm_max_m(3584, 3584) == 0  # qkv, o
    assert ql._mma_gemm_max_m(37888, 3584) == 64 and ql._mma_gemm_max_m(3584, 18944) == 64
    monkeypatch.setenv("PAGODA_W4A16_MMA_GEMM_MAX_M", "7x")
    with pytest.raises(ValueError, match="PAGODA_W4A16_MMA_GEMM_MAX_M"):
        ql._mma_gemm_max_m(4608, 3584)
    monkeypatch.delenv("PAGODA_W4A16_MMA_GEMM_MAX_M")
    monkeypatch.setenv("PAGODA_W4A16_MMA_SHARED", "0")  # the per-block kernel: smaller limits
    assert ql._mma_max_m(4608, 3584) == 16 and ql._mma_max_m(37888, 3584) == 32


# (M, N = 2 I, K, group, config, bias): the gated GEMV (gate_up_proj + SiLU-and-mul): odd step
# counts, split-K (gate and up partials meet in the workspace), per-channel, bias on both halves.
GATED_CASES = [
    (1, 64, 128, 64, (2, 1, 1), False),
    (3, 96, 576, 64, (1, 3, 1), True),
    (8, 32, 256, -1, (2, 1, 2), False),
    (5, 64, 512, 128, (2, 2, 1), True),
]


@pytest.mark.parametrize("m,n,k,group,config,bias", GATED_CASES)
def test_mma_gemv_gated_interpreter(m, n, k, group, config, bias) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, group, seed=5)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    half = n // 2
    expect = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
    y = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config, gated=True)
    assert y.shape == (m, half) and y.dtype == torch.bfloat16
    assert (y.float() - expect).abs().max().item() <= 2.0**-7 * expect.abs().max().item()
    if config[1] > 1:  # the workspace and counters are clean again: a second call is identical
        again = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config, gated=True)
        assert torch.equal(y, again)


def test_gated_config_follows_the_shape() -> None:
    assert mm.default_gated_config(1, 37888, 3584, 132) == (2, 1, 2)  # 7B gate_up: no split
    kt, split, warps = mm.default_gated_config(1, 3072, 576, 132)  # SmolLM2: 96 column groups
    assert (kt, warps) == (2, 2) and split > 1


def test_mma_gemv_gated_rejects_what_it_cannot_fuse() -> None:
    x, words, pairs, *_ = _case(1, 48, 128, 64)
    with pytest.raises(ValueError, match="gated=True"):
        mm.wna16_mma_gemv(x, words, pairs, 48, 64, gated=True)  # N / 2 not a multiple of 16
    x, words, pairs, *_ = _case(9, 64, 128, 64)
    with pytest.raises(ValueError, match="M <= 8"):
        mm.wna16_mma_gemv(x, words, pairs, 64, 64, gated=True)


def _mma_layer(cls, inp, outs, seed, bias=True):
    """A W4A16 layer moved into the tensor-core layout by hand (the layout is chosen on CUDA
    only): the interpreter runs its path. Returns (layer, method, codes, scales)."""
    from pagoda.kernels.wna16 import pack_to_int32
    from pagoda.layers import quantized_linear as ql

    out = sum(outs)
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    scale = (torch.rand(out, inp // 64, generator=g) * 0.02 + 0.001).bfloat16()
    method = ql.WNA16LinearMethod(ql.WeightQuantArgs(4, True, 64))
    sizes = outs if len(outs) > 1 else outs[0]
    layer = cls(inp, sizes, bias=bias, linear_method=method, dtype=torch.bfloat16)
    layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
    layer.weight_scale.data.copy_(scale)
    if bias:
        layer.bias.data.normal_(generator=g)
    method.process_weights_after_loading(layer)
    assert layer.wna16_backend == "dequant"
    for name in ("codes", "scales"):
        delattr(layer, name)
    layer.mma_words = torch.nn.Parameter(mm.repack_mma(q.to(torch.int32) + 8), False)
    layer.mma_scales = torch.nn.Parameter(mm.repack_mma_scales(scale.t().contiguous()), False)
    layer.wna16_backend = "mma"
    return layer, method, q, scale


def test_gate_up_layer_fuses_silu_and_mul_interpreter(monkeypatch) -> None:
    """`MergedColumnLinear.silu_and_mul` with `PAGODA_W4A16_FUSED_SILU=1`: silu(gate) * up from
    the gated GEMV at M <= 8; None (the caller runs projection + activation) past 8 rows,
    without the switch (the default), or on a layer whose method cannot fuse."""
    from pagoda.layers.linear import MergedColumnLinear

    monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "1")
    layer, _, q, scale = _mma_layer(MergedColumnLinear, 256, [32, 32], seed=4)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = wna16_linear_ref(x.float(), q, scale.float(), None, 64, bias=layer.bias.float())
    expect = torch.nn.functional.silu(ref[:, :32]) * ref[:, 32:]
    for m in (1, 8):
        y = layer.silu_and_mul(x[:m])
        assert y.shape == (m, 32)
        assert (y.float() - expect[:m]).abs().max().item() <= 2.0**-7 * expect.abs().max().item()
    assert layer.silu_and_mul(x) is None  # 9 rows
    monkeypatch.delenv("PAGODA_W4A16_FUSED_SILU")
    assert layer.silu_and_mul(x[:1]) is None  # opt-in
    monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "0")
    assert layer.silu_and_mul(x[:1]) is None
    monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "maybe")
    with pytest.raises(ValueError, match="PAGODA_W4A16_FUSED_SILU='maybe'"):
        layer.silu_and_mul(x[:1])
    monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "1")
    dense = MergedColumnLinear(256, [32, 32], dtype=torch.bfloat16)
    assert dense.silu_and_mul(x[:1]) is None  # unquantized: no fused kernel


# (M, N, K, group, config, bias): 2 and 4 blocks sharing one dequantization, split-K (serial
# reduction of every block), odd step counts, per-channel, and M = 33-64 as two launches.
SHARED_CASES = [
    (9, 32, 128, 64, (2, 1, 1), False),
    (16, 48, 576, 64, (1, 3, 1), True),
    (27, 16, 256, -1, (2, 1, 2), False),
    (32, 32, 512, 128, (2, 2, 1), True),
    (45, 32, 256, 128, (2, 2, 1), True),
]


@pytest.mark.parametrize("m,n,k,group,config,bias", SHARED_CASES)
def test_mma_gemv_shared_dequant_interpreter(m, n, k, group, config, bias) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, group, seed=11)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    y = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config, shared=True)
    assert y.shape == (m, n)
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()
    old = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config, shared=False)
    assert torch.equal(y, old)  # the same sums in the same order under the interpreter


# (M, N, K, group, (BLOCK_M, CG, T, split, warps, stages), bias): one and several M blocks,
# split-K (fp32 partials), column groups that CG does not divide, per-channel, group 64.
GEMM_CASES = [
    (20, 32, 256, 128, (16, 2, 2, 1, 4, 1), False),
    (70, 64, 512, 64, (32, 4, 2, 2, 4, 1), True),
    (5, 48, 576, -1, (16, 4, 4, 3, 4, 1), True),
    (33, 80, 384, 128, (32, 8, 1, 1, 4, 1), False),
]


@pytest.mark.parametrize("m,n,k,group,config,bias", GEMM_CASES)
def test_mma_gemm_interpreter(m, n, k, group, config, bias) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, group, seed=17)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    y = mm.wna16_mma_gemm(x, words, pairs, n, group, bias=b, config=config)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_mma_gemm_rejects_bad_input() -> None:
    x, words, pairs, *_ = _case(4, 32, 128, 64)
    with pytest.raises(ValueError, match="wna16_mma_gemm"):
        mm.wna16_mma_gemm(x.float(), words, pairs, 32, 64)
    with pytest.raises(ValueError, match="wna16_mma_gemm"):
        mm.wna16_mma_gemm(x, words, pairs, 32, 32)


def test_shared_asm_operands_line_up() -> None:
    """The generated asm names exactly the operands its constraint string declares."""
    import re

    for nbb, asm, cons in ((2, mm._ASM_S2, mm._CONS_S2), (4, mm._ASM_S4, mm._CONS_S4)):
        used = {int(v) for v in re.findall(r"\$(\d+)", str(asm))}
        n_ops = len(str(cons).split(","))
        assert used == set(range(n_ops)) and n_ops == 4 * nbb + 4 + 8 * nbb + 1 + 4 * nbb
        assert str(asm).count("mma.sync") == 4 * nbb and str(asm).count("fma.rn.bf16x2") == 16


def test_self_test_passes_and_catches_wrong_results(monkeypatch) -> None:
    assert mm.self_test_on(torch.device("cpu"))
    assert mm.self_test_on(torch.device("cpu"), shared=True)
    monkeypatch.setattr(mm, "wna16_mma_gemv", lambda x, *a, **kw: torch.zeros(x.shape[0], 32))
    with pytest.warns(UserWarning, match="wrong results"):
        assert not mm.self_test_on(torch.device("cpu"))

    def broken(*a, **kw):
        raise RuntimeError("no mma here")

    monkeypatch.setattr(mm, "wna16_mma_dequant", broken)
    with pytest.warns(UserWarning, match="no mma here"):
        assert not mm.self_test_on(torch.device("cpu"))


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [1, 2, 8, 13, 64])
def test_mma_gemv_qwen7b_gpu(m, n, k) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, 128, device="cuda")
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config", [(1, 1, 1), (2, 1, 1), (4, 8, 1), (4, 8, 2), (8, 4, 4), (16, 2, 8)]
)
def test_mma_gemv_configs_gpu(config) -> None:
    x, words, pairs, ref, _, _ = _case(4, 3584, 18944, 128, device="cuda", seed=5)
    b = torch.randn(3584, device="cuda").to(torch.bfloat16)
    y = mm.wna16_mma_gemv(x, words, pairs, 3584, 128, bias=b, config=config)
    expect = ref + b.float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=1e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [(0, False), (4, False), (4, True), (1 << 20, False)])
@pytest.mark.parametrize("n,k,config", [(37888, 3584, (2, 1, 1)), (3584, 18944, (4, 5, 2))])
def test_mma_gemv_l2_prefetch_gpu(prefetch, n, k, config) -> None:
    """The bulk L2 prefetch is only a hint: the same result with and without it (bit-identical
    without split-K; with it the partials' atomic order varies: one bf16 ulp)."""
    x, words, pairs, ref, _, _ = _case(1, n, k, 128, device="cuda", seed=9)
    base = mm.wna16_mma_gemv(x, words, pairs, n, 128, config=config, prefetch=(0, False))
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128, config=config, prefetch=prefetch)
    if config[1] == 1:
        assert torch.equal(y, base)
    else:
        assert (y.float() - base.float()).abs().max().item() <= 2.0**-7 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [9, 16, 17, 32, 40, 64])
def test_mma_gemv_shared_dequant_gpu(m, n, k) -> None:
    """M = 9-64 with one dequantization shared by the blocks (the default there) against the
    reference and against the per-block kernel."""
    assert mm.mma_shared_self_test(0)
    x, words, pairs, ref, _, _ = _case(m, n, k, 128, device="cuda", seed=13)
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128)
    tol = 2e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=tol)
    old = mm.wna16_mma_gemv(x, words, pairs, n, 128, shared=False)
    assert (y.float() - old.float()).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(2, 1, 1), (2, 1, 2), (4, 1, 2), (4, 3, 2), (8, 2, 4)])
@pytest.mark.parametrize("m", [12, 30])
def test_mma_gemv_shared_configs_gpu(m, config) -> None:
    x, words, pairs, ref, _, _ = _case(m, 3584, 18944, 128, device="cuda", seed=15)
    b = torch.randn(3584, device="cuda").to(torch.bfloat16)
    y = mm.wna16_mma_gemv(x, words, pairs, 3584, 128, bias=b, config=config, shared=True)
    expect = ref + b.float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=1e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [17, 64, 100, 512])
def test_mma_gemm_qwen7b_gpu(m, n, k) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, 128, device="cuda", seed=19)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = mm.wna16_mma_gemm(x, words, pairs, n, 128, bias=b)
    expect = ref + b.float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=1e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
def test_mma_dequant_is_exact_gpu() -> None:
    _, words, pairs, _, q, scale = _case(1, 4608, 3584, 128, device="cuda")
    w = mm.wna16_mma_dequant(words, pairs, 4608, 3584, 128)
    ref = dequantize_weight(q, scale, None, 128, None, torch.bfloat16)
    assert torch.equal(w.cpu(), ref)


@pytest.mark.gpu
def test_mma_gemv_cuda_graph_gpu() -> None:
    x, words, pairs, ref, _, _ = _case(1, 3584, 18944, 128, device="cuda", seed=7)
    mm.wna16_mma_gemv(x, words, pairs, 3584, 128)  # warm-up: compiles, sizes the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm.wna16_mma_gemv(x, words, pairs, 3584, 128)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_quantized_layer_uses_the_mma_layout_gpu(monkeypatch) -> None:
    from pagoda.kernels.wna16 import pack_to_int32
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantized_linear import WeightQuantArgs, WNA16LinearMethod

    inp, out = 1024, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    scale = torch.rand(out, inp // 128, generator=g) * 0.02 + 0.001
    x = torch.randn(100, inp, generator=g)
    method = WNA16LinearMethod(WeightQuantArgs(4, True, 128))
    with torch.device("cuda"):
        layer = ReplicatedLinear(inp, out, bias=True, linear_method=method, dtype=torch.bfloat16)
    layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.normal_()
    method.process_weights_after_loading(layer)
    assert mm.mma_self_test(torch.cuda.current_device())
    assert layer.wna16_backend == "mma" and not hasattr(layer, "qweight_t")
    ref = wna16_linear_ref(x, q, scale.bfloat16().float(), None, 128, bias=layer.bias.float().cpu())
    for m in (1, 7, 64, 100):  # GEMV (1 and 2 blocks of 8, 8 blocks), dequant + cuBLAS
        y = layer(x[:m].cuda().bfloat16())
        torch.testing.assert_close(y.float().cpu(), ref[:m], rtol=2e-2, atol=3e-2)
    w = method.dequantized_weight(layer)
    expect = dequantize_weight(q, scale.bfloat16(), None, 128, None, torch.bfloat16)
    assert torch.equal(w.cpu(), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1), (2, 4, 2)])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_mma_gemv_gated_qwen7b_gpu(m, config) -> None:
    """gate_up_proj of Qwen2.5-7B (I = 18944) with the SwiGLU in the epilogue, every config the
    benchmark sweeps, against silu(gate) * up of the fp32 reference."""
    n, k = 37888, 3584
    x, words, pairs, ref, _, _ = _case(m, n, k, 128, device="cuda", seed=11)
    half = n // 2
    expect = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128, config=config, gated=True)
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=2e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
def test_decoder_mlp_fused_silu_matches_unfused_gpu(monkeypatch) -> None:
    """The MLP of a W4A16 model at decode sizes: the gated GEMV path (one kernel less) gives
    what projection + SiLU-and-mul + down give, and both match the dequantized weights; a
    captured CUDA graph of the fused MLP replays to the same output."""
    from types import SimpleNamespace

    from pagoda.kernels.wna16 import pack_to_int32
    from pagoda.layers.quantized_linear import WeightQuantArgs, WNA16LinearMethod
    from pagoda.models.llama import DecoderMLP, DecoderOptions

    hidden, inter = 1024, 2816
    cfg = SimpleNamespace(hidden_act="silu", hidden_size=hidden, intermediate_size=inter)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the layers' dtype (the MMA layout is bf16 only)
    try:
        with torch.device("cuda"):
            mlp = DecoderMLP(
                cfg,
                DecoderOptions(),
                lambda p: WNA16LinearMethod(WeightQuantArgs(4, True, 128)),
                "mlp",
            )
    finally:
        torch.set_default_dtype(default_dtype)
    g = torch.Generator().manual_seed(3)
    dense = {}
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        q = torch.randint(-8, 8, (layer.out_features, layer.in_features), generator=g)
        q = q.to(torch.int8)
        scale = torch.rand(layer.out_features, layer.in_features // 128, generator=g) * 0.02 + 1e-3
        layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
        layer.weight_scale.data.copy_(scale)
        layer.linear_method.process_weights_after_loading(layer)
        assert layer.wna16_backend == "mma"
        dense[layer] = dequantize_weight(q, scale.bfloat16(), None, 128, None).float().cuda()
    x = torch.randn(8, hidden, generator=g).cuda().bfloat16()
    gu = x.float() @ dense[mlp.gate_up_proj].t()
    ref = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ dense[mlp.down_proj].t()
    monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "1")
    for m in (1, 3, 8):
        assert mlp.gate_up_proj.silu_and_mul(x[:m]) is not None  # the fused path is taken
        fused = mlp(x[:m])
        monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "0")
        assert mlp.gate_up_proj.silu_and_mul(x[:m]) is None
        unfused = mlp(x[:m])
        monkeypatch.setenv("PAGODA_W4A16_FUSED_SILU", "1")
        tol = 2e-2 * ref.abs().max().item()
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=2e-2, atol=tol)
        torch.testing.assert_close(fused.float(), ref[:m], rtol=2e-2, atol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mlp(x[:1])
    graph.replay()
    torch.cuda.synchronize()
    # split-K sums in arrival order: equal up to fp32 rounding
    torch.testing.assert_close(
        y.float(), mlp(x[:1]).float(), rtol=1e-2, atol=1e-2 * y.abs().max().item()
    )

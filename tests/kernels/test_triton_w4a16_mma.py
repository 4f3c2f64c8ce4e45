"""The tensor-core W4A16 GEMV (`triton_w4a16_mma`): repacking, the fragment-level emulator, the
kernel's bookkeeping under the Triton interpreter (which runs the same tile product without PTX),
and on the GPU the real `mma.sync` path against `wna16_linear_ref`."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.wna16 import triton_w4a16_mma as mm
from pagoda.kernels.wna16.reference import wna16_linear_ref
from pagoda.kernels.workspace import SplitKWorkspace
from pagoda.quant.dequant import dequantize_weight

WS = SplitKWorkspace()  # split-K scratch, as the model runner owns one


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


def _zp_case(m, n, k, group, seed=0, device="cpu"):
    """Asymmetric weights (AWQ / GPTQ with zero points): unsigned codes u and zeros z in 0..15,
    W = (u - z) * s; the reference is the fp32 matmul of the independently dequantized W."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group <= 0 else group
    u = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 16, (n, k // gs), generator=g)
    scale = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (u - z.repeat_interleave(gs, 1)).float() * scale.float().repeat_interleave(gs, 1)
    ref = x.float() @ w.t()
    words = mm.repack_mma(u.to(torch.int32))
    pairs = mm.repack_mma_scales(scale.t().contiguous())
    zeros = mm.repack_mma_zeros(z.t().contiguous())
    dev = [t.to(device) for t in (x, words, pairs, zeros)]
    return (*dev, ref, w)


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
    assert mm.mma_supported(48, 192, 64, 4, True)  # zero points
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
    (1, 32, 2048, 128, (2, 16, 1), True),  # 16 K slices of one step each
]


@pytest.mark.parametrize("m,n,k,group,config,bias", CASES)
def test_mma_gemv_interpreter(m, n, k, group, config, bias) -> None:
    x, words, pairs, ref, _, _ = _case(m, n, k, group)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    y = mm.wna16_mma_gemv(x, words, pairs, n, group, bias=b, config=config, workspace=WS)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # one bf16 ulp of the largest output (the interpreter's fp32 -> bf16 cast truncates)
    tol = 2.0**-7 * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol


def test_mma_gemv_reuses_its_workspace_between_calls() -> None:
    """Split-K leaves the shared workspace and counters zeroed: a second call is identical."""
    x, words, pairs, ref, _, _ = _case(2, 32, 512, 128, seed=3)
    ws = SplitKWorkspace()
    a = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 4, 1), workspace=ws)
    assert ws.all_buffers()  # split-K took the workspace's serial reduction
    b = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 4, 1), workspace=ws)
    assert torch.equal(a, b)
    assert all(not bool(t.any()) for t in ws.all_buffers())  # zeroed again for the next call
    assert (a.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()
    c = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(1, 4, 1))  # no workspace: no split
    assert (c.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_mma_gemv_rejects_bad_input() -> None:
    x, words, pairs, *_ = _case(1, 32, 128, 64)
    with pytest.raises(ValueError, match="M <= 64"):
        mm.wna16_mma_gemv(x.repeat(65, 1), words, pairs, 32, 64, workspace=WS)
    with pytest.raises(ValueError, match="bf16"):
        mm.wna16_mma_gemv(x.float(), words, pairs, 32, 64, workspace=WS)
    with pytest.raises(ValueError, match="unsupported shape"):
        mm.wna16_mma_gemv(x, words, pairs, 32, 32, workspace=WS)
    with pytest.raises(ValueError, match="bias"):
        mm.wna16_mma_gemv(
            x, words, pairs, 32, 64, bias=torch.zeros(31, dtype=torch.bfloat16), workspace=WS
        )


@pytest.mark.parametrize("group", [64, -1])
def test_mma_dequant_interpreter(group) -> None:
    _, words, pairs, _, q, scale = _case(1, 48, 576, group)
    w = mm.wna16_mma_dequant(words, pairs, 48, 576, group)
    ref = dequantize_weight(q, scale.float(), None, 576 if group <= 0 else group, None)
    rel = (w.float() - ref).abs() / ref.abs().clamp_min(1e-9)
    assert rel.max().item() <= 2.0**-7  # truncating cast in the interpreter; exact on the GPU


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
    assert mm.default_mma_config(1, 37888, 3584, 132) == (2, 1, 1)  # 2,368 column groups
    kt, split, warps = mm.default_mma_config(1, 3584, 18944, 132)
    assert split > 1 and warps == 2
    assert mm.default_mma_config(16, 4608, 3584, 132) == (4, 2, 2)
    # Qwen2.5-3B: gate_up (1,376 groups) splits in two, down (128 groups) in 16
    assert mm.default_mma_config(1, 22016, 2048, 132) == (2, 2, 1)
    assert mm.default_mma_config(1, 2048, 11008, 132) == (4, 16, 2)
    # ... at M = 1 only: M = 8 keeps one slice on gate_up and 8 on down (both measured faster)
    assert mm.default_mma_config(8, 22016, 2048, 132) == (2, 1, 1)
    assert mm.default_mma_config(8, 2048, 11008, 132) == (4, 8, 2)
    assert mm.default_mma_config(16, 2048, 11008, 132)[1] == 8
    assert mm._k_tiles_per_step(576, 4) == 1 and mm._k_tiles_per_step(3584, 4) == 4


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
    y = mm.wna16_mma_gemv(
        x, words, pairs, n, group, bias=b, config=config, shared=True, workspace=WS
    )
    assert y.shape == (m, n)
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()
    old = mm.wna16_mma_gemv(
        x, words, pairs, n, group, bias=b, config=config, shared=False, workspace=WS
    )
    assert torch.equal(y, old)  # the same sums in the same order under the interpreter


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
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128, workspace=WS)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 8, 1), (4, 8, 2), (4, 16, 2), (8, 4, 4), (16, 2, 8)],
)
def test_mma_gemv_configs_gpu(config) -> None:
    x, words, pairs, ref, _, _ = _case(4, 3584, 18944, 128, device="cuda", seed=5)
    b = torch.randn(3584, device="cuda").to(torch.bfloat16)
    y = mm.wna16_mma_gemv(x, words, pairs, 3584, 128, bias=b, config=config, workspace=WS)
    expect = ref + b.float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=1e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [9, 16, 17, 32, 40, 64])
def test_mma_gemv_shared_dequant_gpu(m, n, k) -> None:
    """M = 9-64 with one dequantization shared by the blocks (the default there) against the
    reference and against the per-block kernel."""
    assert mm.mma_shared_self_test(0)
    x, words, pairs, ref, _, _ = _case(m, n, k, 128, device="cuda", seed=13)
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128, workspace=WS)
    tol = 2e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=tol)
    old = mm.wna16_mma_gemv(x, words, pairs, n, 128, shared=False, workspace=WS)
    assert (y.float() - old.float()).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(2, 1, 1), (2, 1, 2), (4, 1, 2), (4, 3, 2), (8, 2, 4)])
@pytest.mark.parametrize("m", [12, 30])
def test_mma_gemv_shared_configs_gpu(m, config) -> None:
    x, words, pairs, ref, _, _ = _case(m, 3584, 18944, 128, device="cuda", seed=15)
    b = torch.randn(3584, device="cuda").to(torch.bfloat16)
    y = mm.wna16_mma_gemv(
        x, words, pairs, 3584, 128, bias=b, config=config, shared=True, workspace=WS
    )
    expect = ref + b.float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), expect, rtol=1e-2, atol=2e-2 * expect.abs().max().item()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [17, 64, 100, 512])
def test_mma_gemm_bias_qwen7b_gpu(m, n, k) -> None:
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
    mm.wna16_mma_gemv(
        x, words, pairs, 3584, 128, workspace=WS
    )  # warm-up: compiles, sizes the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm.wna16_mma_gemv(x, words, pairs, 3584, 128, workspace=WS)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_quantized_layer_uses_the_mma_layout_gpu(monkeypatch) -> None:
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantized_linear import WeightQuantArgs, WNA16LinearMethod
    from pagoda.quant.packing import pack_to_int32

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


# ------------------------------------------------------------ zero points (asymmetric weights)


def test_zero_pairs_round_trip_and_reject_bad_codes() -> None:
    z = torch.randint(0, 16, (3, 48), generator=torch.Generator().manual_seed(2))
    pairs = mm.repack_mma_zeros(z)
    assert pairs.shape == (3, 3, 8) and pairs.dtype == torch.int32
    assert torch.equal(mm.unpack_mma_zeros(pairs).long(), z)
    with pytest.raises(ValueError, match="0..15"):
        mm.repack_mma_zeros(torch.full((1, 16), 16))


ZP_CASES = [  # (M, N, K, group, config, shared): M <= 8, 2 and 4 shared blocks, split-K
    (1, 32, 128, 64, (2, 1, 1), False),
    (5, 48, 576, 64, (1, 3, 1), False),
    (12, 32, 256, 128, (2, 2, 1), True),
    (27, 16, 256, -1, (2, 1, 2), True),
]


@pytest.mark.parametrize("m,n,k,group,config,shared", ZP_CASES)
def test_mma_gemv_zero_points_interpreter(m, n, k, group, config, shared) -> None:
    x, words, pairs, zeros, ref, _ = _zp_case(m, n, k, group, seed=23)
    y = mm.wna16_mma_gemv(x, words, pairs, n, group, config=config, shared=shared,
                          zero_pairs=zeros, workspace=WS)  # fmt: skip
    assert y.shape == (m, n)
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_zero_pairs_of_eight_equal_the_symmetric_path() -> None:
    """z = 8 everywhere is the symmetric code offset: the same result as no zero pairs."""
    x, words, pairs, _, _, _ = _case(3, 32, 256, 128, seed=4)
    eights = mm.repack_mma_zeros(torch.full((2, 32), 8))
    a = mm.wna16_mma_gemv(x, words, pairs, 32, 128, config=(2, 1, 1), workspace=WS)
    b = mm.wna16_mma_gemv(
        x, words, pairs, 32, 128, config=(2, 1, 1), zero_pairs=eights, workspace=WS
    )
    assert torch.equal(a, b)


def test_mma_dequant_zero_points_interpreter() -> None:
    _, words, pairs, zeros, _, w = _zp_case(1, 48, 576, 64, seed=5)
    d = mm.wna16_mma_dequant(words, pairs, 48, 576, 64, zero_pairs=zeros)
    # (u - z) * s is exact in fp32; the interpreter's cast to bf16 truncates: <= 1 ulp
    assert ((d.float() - w).abs() <= 2.0**-7 * w.abs()).all()


def test_zero_point_asm_operands_line_up() -> None:
    import re

    for asm, cons in (
        (mm._ASM, mm._CONSTRAINTS),
        (mm._ASM_Z, mm._CONSTRAINTS_Z),
        (mm._ASM_S2Z, mm._CONS_S2Z),
        (mm._ASM_S4Z, mm._CONS_S4Z),
        (mm._UNPACK_ASM, mm._UNPACK_CONS),
    ):
        used = {int(v) for v in re.findall(r"\$(\d+)", str(asm))}
        assert used == set(range(len(str(cons).split(","))))


# (M, N, K, group, (BLOCK_M, CG, T, split, warps, stages, swap), bias, zero points): the
# tensor-core GEMM: swap-AB and not, several M blocks, split-K, CG not dividing the column
# groups, per-channel, group 64, zero points.
TC_CASES = [
    (20, 32, 256, 128, (16, 2, 2, 1, 4, 1, True), False, False),
    (70, 64, 512, 64, (32, 4, 1, 2, 4, 1, False), True, True),
    (5, 48, 576, -1, (16, 4, 4, 3, 4, 1, True), True, False),
    (33, 80, 384, 128, (64, 8, 2, 1, 4, 1, False), False, True),
]


@pytest.mark.parametrize("m,n,k,group,config,bias,zp", TC_CASES)
def test_mma_gemm_interpreter(m, n, k, group, config, bias, zp) -> None:
    if zp:
        x, words, pairs, zeros, ref, _ = _zp_case(m, n, k, group, seed=29)
    else:
        (x, words, pairs, ref, _, _), zeros = _case(m, n, k, group, seed=29), None
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    if bias:
        ref = ref + b.float()
    y = mm.wna16_mma_gemm(x, words, pairs, n, group, bias=b, config=config, zero_pairs=zeros)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [1, 8, 13, 33, 64])
def test_mma_gemv_zero_points_qwen7b_gpu(m, n, k) -> None:
    x, words, pairs, zeros, ref, w = _zp_case(m, n, k, 128, device="cuda", seed=31)
    y = mm.wna16_mma_gemv(x, words, pairs, n, 128, zero_pairs=zeros, workspace=WS)
    tol = 2e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=tol)
    d = mm.wna16_mma_dequant(words, pairs, n, k, 128, zero_pairs=zeros)
    assert torch.equal(d.cpu(), w.to(torch.bfloat16))  # exact product, rounded once


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [16, 33, 64, 128, 256])
@pytest.mark.parametrize("zp", [False, True])
def test_mma_gemm_qwen7b_gpu(m, n, k, zp) -> None:
    if zp:
        x, words, pairs, zeros, ref, _ = _zp_case(m, n, k, 128, device="cuda", seed=37)
    else:
        (x, words, pairs, ref, _, _), zeros = _case(m, n, k, 128, device="cuda", seed=37), None
    y = mm.wna16_mma_gemm(x, words, pairs, n, 128, zero_pairs=zeros)
    tol = 2e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=tol)

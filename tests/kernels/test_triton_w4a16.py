"""Triton W4A16 / W8A16 GEMM and GEMV against the torch reference (interpreter on CPU, GPU when
present)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.wna16.reference import wna16_linear_ref
from pagoda.quant.packing import pack_to_int32


def _case(m, n, k, group, bits, asym, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    gs = k if group == -1 else group
    q = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, -(-k // gs), generator=g) * 0.02 + 0.001).to(dtype)
    zp = torch.randint(lo, hi, scale.shape, generator=g).to(torch.int8) if asym else None
    x = torch.randn(m, k, generator=g).to(dtype)
    qt = pack_to_int32(q, bits, 1).t().contiguous()
    zt = None if zp is None else (zp.float() + (1 << (bits - 1))).t().contiguous().to(dtype)
    # fp32 reference from the same (dtype-rounded) activations and scales
    ref = wna16_linear_ref(x.float(), q, scale.float(), zp, gs)
    return (
        x.to(device),
        qt.to(device),
        scale.t().contiguous().to(device),
        None if zt is None else zt.to(device),
        gs,
        ref,
    )


@pytest.mark.parametrize(
    "m,n,k,group,bits,asym,split",
    [
        (1, 64, 128, 32, 4, False, 2),
        (17, 48, 192, 64, 4, True, 1),
        (3, 32, 100, -1, 4, True, 1),
        (5, 64, 128, 32, 8, True, 3),
    ],
)
def test_wna16_gemm_interpreter(m, n, k, group, bits, asym, split) -> None:
    from pagoda.kernels.wna16.triton_w4a16 import GemmConfig, wna16_gemm

    x, qt, st, zt, gs, ref = _case(m, n, k, group, bits, asym)
    out = wna16_gemm(x, qt, st, zt, gs, bits, GemmConfig(16, 32, 32, split_k=split))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- split-K GEMV (M <= 16)
#
# Tolerances. The kernel forms exactly the products of the reference (codes minus zero are
# exact small integers in fp32 and in bf16 / fp16 for the tensor-core path; x and the scales
# are the same rounded values) and sums them in fp32 in another order: with K <= 512 and
# |terms| <= ~0.5 the reordering error is < 1e-5, so an fp32 output must match to 1e-5. An
# output in x's dtype adds one rounding: half an ulp on the GPU (round to nearest), less than
# one ulp in the interpreter (its fp32 -> bf16 cast truncates), so rtol = one ulp (2^-7 for
# bf16's 8 significant bits, 2^-10 for fp16's 11) plus atol for the fp32 error near zero.
_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}


def _check(out, ref, dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, rtol=_RTOL[dtype], atol=1e-5)


def _gemv_cases():
    from pagoda.kernels.wna16.triton_w4a16 import GemvConfig as C

    # (m, n, k, group, bits, asym, dtype, config); the interpreter's bf16 tl.dot is broken
    # (raw bits multiplied), so the tensor-core path runs fp16 / fp32 here, bf16 on the GPU.
    return [
        (1, 256, 512, 128, 4, False, torch.bfloat16, C(256, 64, 4, 1)),  # serial split-K
        (1, 256, 512, 128, 4, False, torch.bfloat16, C(256, 64, 1, 1)),  # one split
        (1, 512, 256, 64, 4, True, torch.bfloat16, C(512, 64, 2, 2, reduce="atomic")),
        (3, 128, 256, 32, 4, True, torch.float16, C(128, 32, 3, 1)),  # FMA path, 3 rows
        (16, 64, 256, 64, 4, False, torch.bfloat16, C(64, 64, 2, 1)),  # FMA path, 16 rows
        (2, 96, 100, -1, 4, True, torch.bfloat16, C(64, 32, 2, 1)),  # per channel, N and K tails
        (1, 128, 256, 128, 8, False, torch.bfloat16, C(128, 32, 3, 1)),  # 8-bit
        (2, 64, 256, 64, 8, True, torch.float16, C(64, 32, 2, 1)),  # 8-bit asym
        (3, 64, 256, 64, 4, False, torch.float32, C(64, 64, 2, 1)),  # fp32 activations
        (16, 128, 512, 128, 4, False, torch.float16, C(64, 128, 4, 4, use_dot=True)),
        (5, 64, 256, 128, 4, True, torch.float16, C(64, 128, 1, 4, use_dot=True)),
        (3, 64, 512, 64, 8, True, torch.float16, C(64, 64, 2, 4, use_dot=True)),
        (4, 96, 200, -1, 4, True, torch.float16, C(64, 128, 2, 4, use_dot=True)),  # tails
        (2, 64, 256, 128, 4, True, torch.float32, C(64, 128, 2, 4, use_dot=True)),
    ]


@pytest.mark.parametrize("case", range(14))
def test_wna16_gemv_interpreter(case) -> None:
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

    m, n, k, group, bits, asym, dtype, cfg = _gemv_cases()[case]
    x, qt, st, zt, gs, ref = _case(m, n, k, group, bits, asym, dtype=dtype, seed=case)
    out = wna16_gemv(x, qt, st, zt, gs, bits, cfg, out_dtype=torch.float32)
    _check(out, ref, torch.float32)
    if dtype != torch.float32 and case % 3 == 0:  # the cast to x's dtype, on a few cases
        _check(wna16_gemv(x, qt, st, zt, gs, bits, cfg), ref, dtype)


def test_wna16_gemv_serial_reduction_interpreter() -> None:
    """The last program of each column tile writes the sum and leaves workspace and counters
    zero, so repeated calls (different shapes, same buffers) stay correct."""
    from pagoda.kernels.wna16.triton_w4a16 import GemvConfig, wna16_gemv
    from pagoda.kernels.workspace import SplitKWorkspace

    workspace = SplitKWorkspace()
    for seed, (m, n, split) in enumerate(((1, 256, 4), (2, 128, 3), (1, 256, 2))):
        x, qt, st, zt, gs, ref = _case(m, n, 512, 64, 4, True, dtype=torch.bfloat16, seed=seed)
        cfg = GemvConfig(128, 64, split, 1)
        for _ in range(2):
            out = wna16_gemv(x, qt, st, zt, gs, 4, cfg, torch.float32, workspace=workspace)
            _check(out, ref, torch.float32)
        bufs = workspace.all_buffers()
        assert len(bufs) == 2 and all(int(b.count_nonzero()) == 0 for b in bufs)
    # without a workspace the atomic reduction runs (a zeroed buffer per call): same result
    _check(wna16_gemv(x, qt, st, zt, gs, 4, cfg, torch.float32), ref, torch.float32)


def test_wna16_gemv_default_config_interpreter() -> None:
    from pagoda.kernels.wna16.triton_w4a16 import default_gemv_config, wna16_gemv

    for m, dtype in ((1, torch.bfloat16), (6, torch.float16)):
        x, qt, st, zt, gs, ref = _case(m, 256, 1024, 128, 4, False, dtype=dtype, seed=m)
        cfg = default_gemv_config(m, 256, 1024, 128, 4, num_sms=8)
        assert cfg.use_dot == (m > 2) and cfg.split_k > 1
        _check(wna16_gemv(x, qt, st, zt, gs, 4, out_dtype=torch.float32), ref, torch.float32)


def test_gemv_configs_and_errors() -> None:
    from pagoda.kernels.wna16.triton_w4a16 import (
        default_gemv_config,
        gemv_candidate_configs,
        gemv_dot_ok,
        wna16_gemv,
    )

    # Qwen2.5-7B decode shapes on an H200: the tiles and splits that won the sweep
    # (w4a16_gemv_h200.json) -- down_proj's best split was 74, the rule gives 75.
    expected = {
        (4608, 3584): (128, 1, 28),
        (3584, 3584): (128, 1, 28),
        (37888, 3584): (1024, 4, 7),
        (3584, 18944): (256, 1, 75),
    }
    for (n, k), (block_n, warps, split) in expected.items():
        cfg = default_gemv_config(1, n, k, 128, 4, num_sms=132)
        assert not cfg.use_dot and cfg.block_k == 64
        assert (cfg.block_n, cfg.num_warps, cfg.split_k) == (block_n, warps, split)
        warps_total = -(-n // cfg.block_n) * cfg.split_k * cfg.num_warps
        assert 4 * 132 <= warps_total <= 9 * 132 and k // cfg.block_k // cfg.split_k >= 2
        assert default_gemv_config(16, n, k, 128, 4, num_sms=132).use_dot
    assert gemv_dot_ok(4096, 128, 4) and not gemv_dot_ok(4096, 64, 4) and gemv_dot_ok(4096, 64, 8)
    assert not default_gemv_config(16, 4096, 4096, 32, 4, 132).use_dot  # K-tile < 16 words
    assert any(c.use_dot for c in gemv_candidate_configs(8, 3584, 128))
    assert not any(c.use_dot for c in gemv_candidate_configs(1, 3584, 128))
    x, qt, st, _, _, _ = _case(17, 64, 128, 32, 4, False)
    with pytest.raises(ValueError, match="M <= 16"):
        wna16_gemv(x, qt, st, None, 32, 4)


# ---------------------------------------------------------------- GPU

QWEN7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 128, 512])
@pytest.mark.parametrize("bits,asym,group", [(4, False, 128), (4, True, 64), (8, False, 128)])
def test_wna16_gemm_gpu(m, bits, asym, group) -> None:
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemm

    x, qt, st, zt, gs, ref = _case(m, 3584, 3584, group, bits, asym, "cuda", torch.bfloat16)
    out = wna16_gemm(x, qt, st, zt, gs, bits)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def _case_gpu(n, k, group, bits, asym, seed=0):
    """_case's weights built on the GPU (the gate/up shape has 136M weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    gs = k if group == -1 else group
    q = torch.randint(lo, hi, (n, k), generator=g, device="cuda").to(torch.int8)
    scale = (torch.rand(n, -(-k // gs), generator=g, device="cuda") * 0.02 + 0.001).bfloat16()
    zp = None
    if asym:
        zp = torch.randint(lo, hi, scale.shape, generator=g, device="cuda").to(torch.int8)
    qt = pack_to_int32(q, bits, 1).t().contiguous()
    zt = None if zp is None else (zp.float() + (1 << (bits - 1))).t().contiguous().bfloat16()
    return q, scale, zp, qt, scale.t().contiguous(), zt, gs


def _check_gpu(x, q, scale, zp, gs, out, out32=None) -> None:
    """fp32 output: 1e-4 of the output scale (up to 18944 fp32 terms summed in another order);
    bf16 output: one bf16 ulp more (round to nearest on the GPU)."""
    ref = wna16_linear_ref(x.float(), q, scale.float(), zp, gs)
    atol = 1e-4 * float(ref.abs().max())
    if out32 is not None:
        torch.testing.assert_close(out32, ref, rtol=1e-4, atol=atol)
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN7B)
def test_wna16_gemv_qwen7b_gpu(n, k) -> None:
    """Default configs on the real decode shapes (bf16 activations, W4A16 group 128)."""
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(n, k, 128, 4, False)
    for m in (1, 2, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out32 = wna16_gemv(x, qt, st, zt, gs, 4, out_dtype=torch.float32)
        _check_gpu(x, q, scale, zp, gs, wna16_gemv(x, qt, st, zt, gs, 4), out32)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,asym,group", [(4, True, 128), (8, False, 128), (4, True, -1)])
def test_wna16_gemv_quant_types_gpu(bits, asym, group) -> None:
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(4608, 3584, group, bits, asym, seed=1)
    for m in (1, 5):  # FMA path, tensor-core path
        x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
        _check_gpu(x, q, scale, zp, gs, wna16_gemv(x, qt, st, zt, gs, bits))


@pytest.mark.gpu
def test_wna16_gemv_candidates_gpu() -> None:
    """Every config the benchmark sweeps is correct, with both reductions and one split, and
    the serial reduction leaves its workspace zero after repeated calls."""
    from dataclasses import replace

    from pagoda.kernels.wna16.triton_w4a16 import gemv_candidate_configs, wna16_gemv
    from pagoda.kernels.workspace import SplitKWorkspace

    workspace = SplitKWorkspace()
    q, scale, zp, qt, st, zt, gs = _case_gpu(4608, 3584, 128, 4, False, seed=2)
    for m in (1, 8):
        x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
        cands = gemv_candidate_configs(m, 3584, 128, 4)
        configs = [*cands, replace(cands[0], split_k=1), replace(cands[0], reduce="atomic")]
        for cfg in configs:
            for _ in range(3):
                out = wna16_gemv(x, qt, st, zt, gs, 4, cfg, workspace=workspace)
                _check_gpu(x, q, scale, zp, gs, out)
    torch.cuda.synchronize()
    assert all(int(b.count_nonzero()) == 0 for b in workspace.all_buffers())


@pytest.mark.gpu
def test_wna16_gemv_cuda_graph_gpu() -> None:
    """Captured once, replayed with new inputs: the serial split-K reduction needs no sync
    (atomics make the fp32 sum order vary, so compare with the reference, not bit-exactly)."""
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv
    from pagoda.kernels.workspace import SplitKWorkspace

    ws = SplitKWorkspace()
    q, scale, zp, qt, st, zt, gs = _case_gpu(37888, 3584, 128, 4, False, seed=3)
    static_x = torch.randn(1, 3584, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, allocates the workspace
        wna16_gemv(static_x, qt, st, zt, gs, 4, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wna16_gemv(static_x, qt, st, zt, gs, 4, workspace=ws)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        _check_gpu(static_x, q, scale, zp, gs, static_out)


def test_tuned_gemv_configs_cover_the_measured_shapes_and_only_their_gpu():
    """The H200 table gives the measured best config; other GPUs / shapes get None."""
    import json

    from pagoda.kernels.wna16.triton_w4a16 import _TUNED_PATH, GemvConfig, tuned_gemv_config

    data = json.loads(_TUNED_PATH.read_text())
    gpu = data["gpu"]
    for e in data["entries"]:
        cfg = tuned_gemv_config(gpu, e["m"], e["n"], e["k"], e["group_size"], e["bits"])
        assert cfg == GemvConfig(**e["config"])
        assert e["us"] <= e["default_us"]  # the sweep includes the default
    e = data["entries"][0]
    assert tuned_gemv_config("some other GPU", e["m"], e["n"], e["k"], 128, 4) is None
    assert tuned_gemv_config(gpu, 1, 123, 456, 128, 4) is None
    # M = 3 takes the M = 4 entry (tensor-core path), never an FMA entry tuned at M <= 2
    cfg = tuned_gemv_config(gpu, 3, 4608, 3584, 128, 4)
    assert cfg is not None and cfg.use_dot


def test_gemv_with_a_tuned_config_matches_the_reference():
    """A tuned config (small split, 1 warp) computes the same result under the interpreter."""
    from pagoda.kernels.wna16.reference import wna16_linear_ref
    from pagoda.kernels.wna16.triton_w4a16 import GemvConfig, wna16_gemv
    from pagoda.quant.packing import pack_to_int32

    torch.manual_seed(0)
    n, k, g = 256, 512, 128
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g) * 0.02 + 0.01
    x = torch.randn(1, k)
    packed_t = pack_to_int32(q.t().contiguous(), 4, packed_dim=0)  # [K/8, N]
    cfg = GemvConfig(block_n=128, block_k=64, split_k=4, num_warps=1, num_stages=3)
    got = wna16_gemv(x, packed_t, scale.t().contiguous(), None, g, 4, config=cfg)
    want = wna16_linear_ref(x, q, scale, None, g)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tuned_gemm_configs_cover_the_measured_shapes_and_stop_at_the_largest_m():
    import json

    from pagoda.kernels.wna16.triton_w4a16 import _TUNED_PATH, GemmConfig, tuned_gemm_config

    data = json.loads(_TUNED_PATH.with_name("w4a16_gemm.json").read_text())
    gpu = data["gpu"]
    for e in data["entries"]:
        cfg = tuned_gemm_config(gpu, e["m"], e["n"], e["k"], e["group_size"], e["bits"])
        assert cfg == GemmConfig(**e["config"])
        assert e["us"] < e["default_us"]  # only entries that beat the heuristic are kept
    e = data["entries"][0]
    assert tuned_gemm_config("another GPU", e["m"], e["n"], e["k"], 128, 4) is None
    largest = max(x["m"] for x in data["entries"] if (x["n"], x["k"]) == (e["n"], e["k"]))
    assert tuned_gemm_config(gpu, largest + 1, e["n"], e["k"], 128, 4) is None  # prefill


def test_gemm_with_a_tuned_config_matches_the_reference():
    from pagoda.kernels.wna16.reference import wna16_linear_ref
    from pagoda.kernels.wna16.triton_w4a16 import GemmConfig, wna16_gemm

    torch.manual_seed(0)
    n, k, g, m = 128, 256, 128, 33
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g) * 0.02 + 0.01
    x = torch.randn(m, k)
    qt = pack_to_int32(q, 4, 1).t().contiguous()  # [K/8, N]
    cfg = GemmConfig(block_m=32, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3)
    got = wna16_gemm(x, qt, scale.t().contiguous(), None, g, 4, cfg)
    want = wna16_linear_ref(x, q, scale, None, g)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- dequantize + cuBLAS (large M)
#
# Exactness: the kernel and `dequantize_packed_t` both form (u - zero) * scale in fp32, which
# is exact (an integer below 2^8 times an 8- or 11-bit significand), and round it once to
# nearest even (the GPU's cvt.rn; in the interpreter, whose cast truncates, integer rounding
# in the kernel). So the weights must be equal bit for bit, not merely close.


def _packed_case(n, k, group, bits, asym, dtype, seed=0):
    """qweight_t / scales_t / zeros_t as the layer holds them, with random codes."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    groups = 1 if group == -1 else -(-k // group)
    q = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(dtype)
    zt = None
    if asym:
        zp = torch.randint(lo, hi, scale.shape, generator=g)
        zt = (zp.float() + hi).t().contiguous().to(dtype)
    return pack_to_int32(q, bits, 1).t().contiguous(), scale.t().contiguous(), zt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_dequant_interpreter(bits, asym, group, dtype) -> None:
    """N = 100 and K = 196 (grouped; a partial last group) or 100 (per channel): neither is a
    multiple of the tiles, and for 4 bits K is not a multiple of 8 (a half-filled last word)."""
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant

    n, k = 100, 100 if group == -1 else 196
    qt, st, zt = _packed_case(n, k, group, bits, asym, dtype, seed=bits + 2 * asym)
    w = wna16_dequant(qt, st, zt, group, bits, k=k)
    ref = dequantize_packed_t(qt, st, zt, group, bits, k, dtype)
    assert w.shape == (n, k) and w.dtype == dtype and w.is_contiguous()
    assert torch.equal(w, ref)
    # the layer passes group_size = K for per-channel weights: the same result
    if group == -1:
        assert torch.equal(wna16_dequant(qt, st, zt, k, bits, k=k), ref)


def test_wna16_dequant_even_tiles_out_slices_and_config_interpreter() -> None:
    """Unmasked tiles (N, K multiples of the tile), a caller's `out`, a non-default config and
    column slices of the inputs (a range of N, as the chunked linear passes them)."""
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import DequantConfig, wna16_dequant

    n, k = 128, 256
    qt, st, zt = _packed_case(n, k, 128, 4, True, torch.bfloat16, seed=5)
    ref = dequantize_packed_t(qt, st, zt, 128, 4, k, torch.bfloat16)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    assert wna16_dequant(qt, st, zt, 128, 4, out) is out
    assert torch.equal(out, ref)
    cfg = DequantConfig(block_n=32, block_k=256, num_warps=4)  # block_k capped to the group
    assert torch.equal(wna16_dequant(qt, st, zt, 128, 4, config=cfg), ref)
    part = wna16_dequant(qt[:, 40:100], st[:, 40:100], zt[:, 40:100], 128, 4, k=k)
    assert torch.equal(part, ref[40:100])


def test_wna16_dequant_errors() -> None:
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant

    qt, st, _ = _packed_case(64, 128, 32, 4, False, torch.bfloat16)
    with pytest.raises(ValueError, match="packed rows"):
        wna16_dequant(qt, st, None, 32, 4, k=200)
    with pytest.raises(ValueError, match="scales_t must be"):
        wna16_dequant(qt, st[:2], None, 32, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        wna16_dequant(qt, torch.ones(11, 64), None, 12, 4)  # a word would straddle groups
    with pytest.raises(ValueError, match="out must be"):
        wna16_dequant(qt, st, None, 32, 4, torch.empty(128, 64, dtype=torch.bfloat16).t())


def test_wna16_dequant_linear_chunks_interpreter() -> None:
    """A scratch budget below the weight: chunks of 64 output rows, each GEMM writing its
    columns of the output; equal to one dense weight through F.linear."""
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant_linear

    n, k = 200, 256
    qt, st, zt = _packed_case(n, k, 64, 4, True, torch.float32, seed=6)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
    expect = torch.nn.functional.linear(x, dequantize_packed_t(qt, st, zt, 64, 4, k, x.dtype))
    whole = wna16_dequant_linear(x, qt, st, zt, 64, 4)
    chunked = wna16_dequant_linear(x, qt, st, zt, 64, 4, max_scratch_bytes=64 * k * 4)
    torch.testing.assert_close(whole, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, expect, rtol=1e-5, atol=1e-5)
    assert wna16_dequant_linear(x[:0], qt, st, zt, 64, 4).shape == (0, n)


def test_large_m_threshold_rule() -> None:
    """The documented numbers: on an H200 (132 SMs) gate_up (37888 columns = 592 GEMM column
    tiles, the GPU filled) switches at M = 140 (168 for 8 bits); down (56 tiles < 132 SMs,
    K >= 2N) from the first M past the GEMV; qkv / o (narrow, short K) at M = 1024 when their
    GEMM config is tuned, else from M = 17."""
    from pagoda.kernels.wna16.reference import large_m_threshold

    assert large_m_threshold(37888, 3584, 4, 132) == 140
    assert large_m_threshold(37888, 3584, 8, 132) == 168
    assert large_m_threshold(3584, 18944, 4, 132) == 17
    assert large_m_threshold(3584, 18944, 4, 132, gemm_tuned=True) == 17
    for n, k in ((4608, 3584), (3584, 3584)):
        assert large_m_threshold(n, k, 4, 132, gemm_tuned=True) == 1024
        assert large_m_threshold(n, k, 4, 132) == 17  # the untuned GEMM loses from M = 17
    assert large_m_threshold(8385, 3584, 4, 132, gemm_tuned=True) == 140
    assert large_m_threshold(8384, 3584, 4, 132, gemm_tuned=True) == 1024
    assert large_m_threshold(2048, 11008, 4, 132) == 17
    assert large_m_threshold(2560, 2048, 4, 132) == 17
    assert large_m_threshold(4608, 3584, 4, 72) == 140  # 72 tiles fill a 72-SM GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN7B)
def test_wna16_dequant_qwen7b_gpu(n, k) -> None:
    """The 7B shapes (W4A16, group 128): the kernel's weight equals the reference bit for bit,
    and dequant + cuBLAS equals the bf16 matmul of that weight (the same cuBLAS call on the
    same operands; one bf16 ulp allowed should cuBLAS pick another algorithm)."""
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant, wna16_dequant_linear

    _, _, _, qt, st, zt, gs = _case_gpu(n, k, 128, 4, False, seed=4)
    w_ref = dequantize_packed_t(qt, st, zt, gs, 4, k, torch.bfloat16)
    assert torch.equal(wna16_dequant(qt, st, zt, gs, 4, k=k), w_ref)
    for m in (32, 128, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expect = torch.nn.functional.linear(x, w_ref)
        out = wna16_dequant_linear(x, qt, st, zt, gs, 4)
        atol = 1e-5 * float(expect.abs().max())
        torch.testing.assert_close(out, expect, rtol=2.0**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,asym,group", [(4, True, 64), (8, False, 128), (8, True, -1)])
def test_wna16_dequant_quant_types_gpu(bits, asym, group) -> None:
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant

    _, _, _, qt, st, zt, gs = _case_gpu(4608, 3584, group, bits, asym, seed=5)
    w_ref = dequantize_packed_t(qt, st, zt, gs, bits, 3584, torch.bfloat16)
    assert torch.equal(wna16_dequant(qt, st, zt, gs, bits, k=3584), w_ref)
    # fp16 scales (from bf16 ones: exact) and an fp16 weight
    st16, zt16 = st.half(), None if zt is None else zt.half()
    w16 = dequantize_packed_t(qt, st16, zt16, gs, bits, 3584, torch.float16)
    assert torch.equal(wna16_dequant(qt, st16, zt16, gs, bits, k=3584), w16)


@pytest.mark.gpu
def test_wna16_dequant_linear_cuda_graph_gpu() -> None:
    """Captured at M = 64 (a decode batch past the GEMV): the scratch comes from the graph's
    pool, PDL (on an H100/H200) keeps the kernel behind the previous cuBLAS call; replays with
    new inputs give the bf16 matmul of the reference weight."""
    from pagoda.kernels.wna16.reference import dequantize_packed_t
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant_linear

    n, k = 3584, 18944
    _, _, _, qt, st, zt, gs = _case_gpu(n, k, 128, 4, True, seed=6)
    w_ref = dequantize_packed_t(qt, st, zt, gs, 4, k, torch.bfloat16)
    static_x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wna16_dequant_linear(static_x, qt, st, zt, gs, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # twice in a row: the second dequant reuses the first scratch block while the first
        # GEMM may still read it, unless the kernel waits (stream order / gdc_wait)
        static_a = wna16_dequant_linear(static_x, qt, st, zt, gs, 4)
        static_b = wna16_dequant_linear(static_x * 2, qt, st, zt, gs, 4)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        expect = torch.nn.functional.linear(static_x, w_ref)
        atol = 1e-5 * float(expect.abs().max())
        torch.testing.assert_close(static_a, expect, rtol=2.0**-7, atol=atol)
        torch.testing.assert_close(static_b, 2 * expect, rtol=2.0**-7, atol=2 * atol)

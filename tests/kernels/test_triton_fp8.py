"""FP8 linear kernels: activation quantization, the FP8-weight GEMV and cuBLASLt's FP8 GEMM.

Oracles are the torch references of `pagoda/kernels/fp8/ops.py` (exact e4m3 products, fp32
accumulation). The Triton interpreter's e4m3 *stores* round wrongly (-124.3 -> -64 where the
nearest e4m3 value is -128), so the quantization kernel is tested on the GPU only; its loads
(e4m3 -> fp32) are exact, so the GEMV runs on the CPU too.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.fp8.ops import (
    FP8_MAX,
    MIN_SCALE,
    fp8_gemv_ref,
    per_token_quant_ref,
    scaled_mm,
    scaled_mm_ref,
    static_quant_ref,
)


def _fp8_gemv():
    """The Triton kernel (interpreted on the CPU); its tests skip where Triton is absent."""
    pytest.importorskip("triton")
    from pagoda.kernels.fp8.triton_gemv import fp8_gemv

    return fp8_gemv


def _weights(n: int, k: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) * 1e-3 + 1e-4
    return w.to(device), s.to(device)


def test_per_token_quant_ref_round_trips_within_half_an_e4m3_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 96, generator=g) * torch.logspace(-3, 2, 8)[:, None]
    x[0] *= 0.5  # max|x| below 448 * MIN_SCALE: the scale floor holds
    q, s = per_token_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)
    # each row's largest |x| maps to exactly 448 unless the scale is at its floor; e4m3 has 3
    # mantissa bits: relative error of a normal value <= 2^-4
    floor = x.abs().amax(1) < FP8_MAX * MIN_SCALE
    assert floor[0] and not floor[1:].any()
    assert torch.all(s[floor] == MIN_SCALE)
    assert torch.allclose(q.float().abs().amax(1)[~floor], torch.full((7,), FP8_MAX))
    err = (q.float() * s - x).abs()
    assert torch.all(err <= x.abs() * 2**-4 + s * 2**-9)  # + the subnormal step 2^-9 * s


def test_all_zero_row_gets_a_finite_scale():
    q, s = per_token_quant_ref(torch.zeros(2, 32))
    assert torch.all(s > 0) and torch.all(q.float() == 0)


def test_e4m3_integer_decode_is_exact_on_every_code():
    """The sm_80 / 87 decode (integer ops, no e4m3 conversion) against torch's, all 254 finite
    codes: normals, subnormals, both zeros."""
    pytest.importorskip("triton")
    from pagoda.kernels.fp8.triton_e4m3 import decode_e4m3

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    got = decode_e4m3(codes)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    if torch.cuda.is_available():  # compiled for this GPU too
        assert torch.equal(decode_e4m3(codes.cuda()).cpu(), want)


def test_e4m3_fp16_bit_decode_is_exact_on_every_code():
    """The attention kernels' 16-bit decode (bits shifted into an fp16, times 2^8) against
    torch's e4m3 -> fp16, all 254 finite codes: the subnormal codes (0x01-0x07, value m 2^-9)
    pass through fp16's subnormals, so an FTZ multiply would zero them."""
    pytest.importorskip("triton")
    from pagoda.kernels.fp8.triton_e4m3 import decode_e4m3

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).half()
    got = decode_e4m3(codes, half=True)
    assert got.dtype == torch.float16
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert torch.count_nonzero(got[1:8]) == 7  # the positive subnormals survive
    if torch.cuda.is_available():
        assert torch.equal(decode_e4m3(codes.cuda(), half=True).cpu(), want)


def test_e4m3_integer_encode_matches_torch():
    """The sm_80 / 87 encode (the FP8 KV cache write there) against torch's conversion: every
    finite code round-trips, each midpoint between neighbours rounds to the even code and its
    float32 neighbours to the nearer one, zeros keep their sign, and 50,000 random values over
    the whole range (normals and subnormals) land on torch's code."""
    pytest.importorskip("triton")
    from pagoda.kernels.fp8.triton_e4m3 import encode_e4m3

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    pos = vals[vals > 0].sort().values
    mids = (pos[:-1] + pos[1:]) / 2
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(50_000, generator=g) * torch.exp2(torch.randn(50_000, generator=g) * 6)
    x = torch.cat([
        vals, mids, -mids, torch.nextafter(mids, torch.zeros_like(mids)),
        torch.nextafter(mids, torch.full_like(mids, 1e9)), wide.clamp(-FP8_MAX, FP8_MAX),
        torch.tensor([1e-30, -1e-30, 2.0**-10, 3 * 2.0**-11]),
    ])  # fmt: skip
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encode_e4m3(vals), codes)
    assert torch.equal(encode_e4m3(x), want)
    # the midpoints' ties went both ways: to the even code, the lower neighbour half the time
    lower = torch.arange(1, 0x7E, dtype=torch.uint8)
    up = want[len(vals) : len(vals) + len(mids)] != lower
    assert up.any() and (~up).any()
    if torch.cuda.is_available():  # compiled for this GPU too
        assert torch.equal(encode_e4m3(x.cuda()).cpu(), want)


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("n,k,bias", [(40, 200, True), (64, 1024, False), (33, 96, True)])
def test_fp8_gemv_matches_reference(n, k, bias, soft):
    fp8_gemv = _fp8_gemv()
    w, s = _weights(n, k)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    got = fp8_gemv(x, w, s, b, block_k=64, soft_e4m3=soft)
    want = fp8_gemv_ref(x, w, s, b)
    # same fp32 products, another summation order: at most one bf16 step apart (one unit in the
    # 8th significant bit: 2^-7 relative at the bottom of a binade)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_fp8_gemv_rejects_bad_operands():
    fp8_gemv = _fp8_gemv()
    w, s = _weights(16, 32)
    with pytest.raises(ValueError, match="M == 1"):
        fp8_gemv(torch.randn(2, 32, dtype=torch.bfloat16), w, s)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemv(torch.randn(1, 32, dtype=torch.bfloat16), w, s.half())


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 3584), (37, 18944), (128, 2048)])
def test_quant_kernel_matches_reference_on_gpu(m, k):
    if not _fp8_gpu():
        pytest.skip("needs sm_89+")
    from pagoda.kernels.fp8.triton_quant import quant_fp8_triton

    # exact division in the kernel (div_rn): with `/` (div.full.f32, 2 ulp) a seed-less run
    # at K 18,944 put one value a code off torch's
    g = torch.Generator(device="cuda").manual_seed(m * k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    q, s = quant_fp8_triton(x)
    qr, sr = per_token_quant_ref(x)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    st = torch.tensor([0.01], device="cuda")
    q2, s2 = quant_fp8_triton(x, st)
    assert torch.equal(q2.view(torch.uint8), static_quant_ref(x, st).view(torch.uint8))
    assert s2.shape == (m, 1) and torch.all(s2 == 0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4608, 3584), (64, 3584, 18944), (200, 512, 256)])
def test_scaled_mm_matches_reference_on_gpu(m, n, k):
    if not _fp8_gpu():
        pytest.skip("needs sm_89+")
    w, s = _weights(n, k, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, xs = per_token_quant_ref(x)
    got = scaled_mm(xq, xs, w, s.view(1, n), b, torch.bfloat16)
    want = scaled_mm_ref(xq, xs, w, s, b, torch.bfloat16)
    # exact products, fp32 accumulation in another order, one bf16 rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.gpu
def test_fp8_gemv_on_gpu():
    fp8_gemv = _fp8_gemv()
    if not _fp8_gpu():
        pytest.skip("needs sm_89+")
    w, s = _weights(3584, 18944, "cuda")
    x = torch.randn(1, 18944, device="cuda", dtype=torch.bfloat16)
    want = fp8_gemv_ref(x, w, s, None).float()
    for soft in (False, True):
        got = fp8_gemv(x, w, s, soft_e4m3=soft).float()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


def _fp8_gemm():
    pytest.importorskip("triton")
    from pagoda.kernels.fp8 import triton_gemm

    return triton_gemm


@pytest.mark.parametrize(
    "m,n,k,bias,split,dtype",
    [
        (2, 64, 256, False, 1, torch.bfloat16),
        (5, 96, 200, True, 1, torch.float16),  # N and K off the tiles
        (16, 128, 512, True, 3, torch.bfloat16),  # split-K, atomics into a fresh buffer
        (33, 40, 384, False, 2, torch.bfloat16),  # BLOCK_M 64 with 31 padding rows
        (128, 64, 256, True, 2, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("soft", [False, True])  # True: sm_80 / 87's integer e4m3 decode
def test_fp8_gemm_matches_reference(m, n, k, bias, split, dtype, soft):
    g = _fp8_gemm()
    w, s = _weights(n, k, seed=m)
    x = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    cfg = g.Fp8GemmConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    got = g.fp8_gemm(x, w, s, b, config=cfg, soft_e4m3=soft)
    want = fp8_gemv_ref(x, w, s, b)  # the fp32 x @ (w * s)^T of any M
    assert got.dtype == dtype and got.shape == (m, n)
    # exact products (an 8-bit x 4-bit significand fits fp32), another summation order, one
    # rounding to x's dtype each: at most one step of it apart (2^-7 relative for bf16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_fp8_gemm_serial_reduction_leaves_the_workspace_zero():
    """The last program of each column tile writes the sums and zeroes what it used, so the
    same buffers serve the next call (another shape) and a repeated one."""
    g = _fp8_gemm()
    from pagoda.kernels.workspace import SplitKWorkspace

    workspace = SplitKWorkspace()
    for seed, (m, n, k, split) in enumerate(((3, 64, 512, 4), (20, 96, 256, 2))):
        w, s = _weights(n, k, seed=seed)
        x = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16)
        cfg = g.Fp8GemmConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
        for _ in range(2):
            got = g.fp8_gemm(x, w, s, b, config=cfg, workspace=workspace)
            torch.testing.assert_close(
                got.float(), fp8_gemv_ref(x, w, s, b).float(), rtol=2**-7, atol=1e-3
            )
        bufs = workspace.all_buffers()
        assert len(bufs) == 2 and all(int(t.count_nonzero()) == 0 for t in bufs)


@pytest.mark.parametrize(
    "m,n,k,bias,split,static",
    [
        (33, 40, 384, True, 1, False),  # BLOCK_M 64 with 31 padding rows, N off the tile
        (64, 96, 200, False, 2, True),  # K off the tile, split-K atomics, one static scale
        (128, 64, 256, True, 3, False),
    ],
)
def test_fp8_gemm_a8_matches_scaled_mm_reference(m, n, k, bias, split, static):
    """e4m3 activations with per-row scales: the W8A8 product cuBLASLt's path computes."""
    g = _fp8_gemm()
    w, s = _weights(n, k, seed=m)
    x = torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]
    if static:
        xq = static_quant_ref(x, torch.tensor([0.02]))
        xs = torch.full((m, 1), 0.02)
    else:
        xq, xs = per_token_quant_ref(x)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    cfg = g.Fp8GemmConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    got = g.fp8_gemm(xq, w, s, b, config=cfg, x_scale=xs, out_dtype=torch.bfloat16)
    want = scaled_mm_ref(xq, xs, w, s, b, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # exact e4m3 x e4m3 products, fp32 sums in another order, one bf16 rounding each
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    with pytest.raises(ValueError, match="x_scale"):
        g.fp8_gemm(xq, w, s, x_scale=None, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        g.fp8_gemm(xq, w, s, x_scale=xs)
    with pytest.raises(ValueError, match="x_scale goes with e4m3"):
        g.fp8_gemm(x.bfloat16(), w, s, x_scale=xs)


def test_fp8_gemm_default_config_and_errors():
    g = _fp8_gemm()
    cfg = g.default_config(64, 2048, 11008, num_sms=132)
    assert cfg.split_k > 1 and cfg.block_n == 64  # 32 column tiles would fill a quarter wave
    assert g.default_config(8, 22016, 2048, num_sms=132).block_n == 128
    assert g.block_m_for(1) == 16 and g.block_m_for(17) == 32 and g.block_m_for(128) == 128
    # e4m3 rows: ~2 waves of 32-wide column tiles (a down_proj: 64 tiles x 4 splits)
    assert g.a8_config(64, 2048, 11008, num_sms=132) == g.Fp8GemmConfig(32, 128, 4, 4, 4)
    assert g.a8_config(128, 22016, 2048, num_sms=132) == g.Fp8GemmConfig(64, 128, 1, 8, 4)
    w, s = _weights(32, 64)
    with pytest.raises(ValueError, match="M <= 128"):
        g.fp8_gemm(torch.randn(129, 64, dtype=torch.bfloat16), w, s)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        g.fp8_gemm(torch.randn(4, 64), w, s)
    with pytest.raises(ValueError, match="w_scale"):
        g.fp8_gemm(torch.randn(4, 64, dtype=torch.bfloat16), w, s.half())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(2, 4608, 3584), (64, 3584, 18944), (128, 2560, 2048)])
def test_fp8_gemm_on_gpu(m, n, k):
    if not _fp8_gpu():
        pytest.skip("needs sm_89+")
    g = _fp8_gemm()
    from pagoda.kernels.workspace import SplitKWorkspace

    w, s = _weights(n, k, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = fp8_gemv_ref(x, w, s, b).float()
    for ws in (None, SplitKWorkspace()):
        for soft in (False, True):  # True: the sm_80 / 87 decode, compiled for this GPU
            got = g.fp8_gemm(x, w, s, b, workspace=ws, soft_e4m3=soft).float()
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
    # e4m3 activations: the tensor cores' FP8 x FP8 dot against the same math in torch
    xq, xs = per_token_quant_ref(x)
    want8 = scaled_mm_ref(xq, xs, w, s, b, torch.bfloat16).float()
    for ws in (None, SplitKWorkspace()):
        got = g.fp8_gemm(xq, w, s, b, workspace=ws, x_scale=xs, out_dtype=torch.bfloat16)
        torch.testing.assert_close(got.float(), want8, rtol=2**-7, atol=1e-2)

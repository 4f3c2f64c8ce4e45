"""Fused RMSNorm / RoPE / SiLU-and-mul: references against the layers, Triton against references.

Layers are checked on the CPU only (on CUDA they call these kernels). Without CUDA the kernels
run under TRITON_INTERPRET=1, set before the kernel module is imported (`@triton.jit` reads it).
Intermediates are rounded as eager torch rounds them: RoPE and the residual sum are bit-exact,
RMSNorm and SiLU within an ulp or two (float32 reduction order, exp).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")  # after the env var: @triton.jit reads it
tl = pytest.importorskip("triton.language")

from pagoda.kernels.norm_act import ops as fused_ops  # noqa: E402
from pagoda.kernels.norm_act.ops import (  # noqa: E402
    apply_rotary_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from pagoda.kernels.norm_act.triton_fused_ops import (  # noqa: E402
    _round,
    apply_rotary_triton,
    fused_add_rms_norm_triton,
    rms_norm_triton,
    silu_and_mul_triton,
)
from pagoda.layers.activation import SiluAndMul  # noqa: E402
from pagoda.layers.norm import RMSNorm  # noqa: E402
from pagoda.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """Same ops and roundings, but a different float32 reduction order, rsqrt or exp: a rounding
    to the model dtype may flip by 1 ulp (2 after RMSNorm's weight multiply)."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.float16:
        return {"atol": 1e-5, "rtol": 2**-9}
    return {"atol": 1e-5, "rtol": 2**-6}


def _exact_tol(dtype: torch.dtype, *, contracted_fp32: bool = False) -> dict[str, float]:
    """Same ops and roundings, elementwise: bit-exact, except that the GPU may contract
    float32 products into FMAs (bf16/fp16 intermediates are rounded, which prevents it)."""
    if DEVICE == "cuda" and dtype == torch.float32 and contracted_fp32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 0.0, "rtol": 0.0}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype=dtype, device=DEVICE)


def _weight(hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return 1 + _randn(hidden, dtype=torch.float32, seed=seed, scale=0.2).to(dtype)


def _rotary_expected(rope, positions, q, k, is_neox=True):
    """The reference rotation of copies of q and k (the inputs stay as they are)."""
    q_exp, k_exp = q.clone(), k.clone()
    apply_rotary_ref(
        positions, q_exp, k_exp, rope.cos_cache, rope.sin_cache, rope.head_dim, is_neox
    )
    return q_exp, k_exp


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DROP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _round(tl.load(x_ptr + offs, mask=offs < n), DROP), mask=offs < n)


@pytest.mark.parametrize("dtype, drop", [(torch.bfloat16, 16), (torch.float16, 13)])
def test_round_matches_torch_cast(dtype, drop):
    """The kernels' bit-level rounding equals torch's round-to-nearest-even cast, ties and
    fp16 subnormals included (values past the fp16 range are not clamped, by design)."""
    magnitudes = torch.logspace(-9, 4, 4096)
    x = _randn(4096, dtype=torch.float32, seed=0) * magnitudes.to(DEVICE)
    ties = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 1.5 * 2**-24, 2.5 * 2**-24]
    x[: 2 * len(ties)] = torch.tensor(ties + [-t for t in ties], device=DEVICE)
    x = x[x.abs() < 60000]
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), DROP=drop, BLOCK=1024)
    assert torch.equal(y, x.to(dtype).float())


# ---- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_refs_match_layer_exactly(dtype):
    layer = RMSNorm(96, eps=1e-5, dtype=dtype)  # on the CPU: the layer's own torch code
    layer.weight.data.copy_(_weight(96, dtype, seed=1).cpu())
    x, residual = _randn(5, 96, dtype=dtype, seed=2).cpu(), _randn(5, 96, dtype=dtype, seed=3).cpu()
    assert torch.equal(rms_norm_ref(x, layer.weight, layer.eps), layer(x))
    out, new_residual = fused_add_rms_norm_ref(x, residual, layer.weight, layer.eps)
    layer_out, layer_residual = layer(x, residual)
    assert torch.equal(out, layer_out) and torch.equal(new_residual, layer_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(7, 576), (3, 128), (1, 1000)])
def test_rms_norm_triton(dtype, num_tokens, hidden):
    """576 = SmolLM2 (not a power of two); 128 packs several rows into one program."""
    x = _randn(num_tokens, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = _weight(hidden, dtype, seed=4)
    out = rms_norm_triton(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_triton(dtype):
    x = _randn(9, 576, dtype=dtype, seed=5)
    residual = _randn(9, 576, dtype=dtype, seed=6, scale=4.0)
    x_before, residual_before = x.clone(), residual.clone()
    weight = _weight(576, dtype, seed=7)
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    # The sum is a single rounding of the same two values.
    torch.testing.assert_close(new_residual, ref_residual, **_exact_tol(dtype))
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_triton_strided_per_head_view():
    """Qwen3's q_norm: [T, H, D] views of a fused QKV row, normalised without a copy."""
    num_tokens, heads, head_dim = 5, 3, 64
    qkv = _randn(num_tokens, (heads + 2) * head_dim, dtype=torch.bfloat16, seed=8)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # row stride 5 * 64
    weight = _weight(head_dim, torch.bfloat16, seed=9)
    out = rms_norm_triton(q, weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_ref(q, weight, 1e-6), **_tol(torch.bfloat16))
    residual = _randn(num_tokens, heads, head_dim, dtype=torch.bfloat16, seed=10)
    out, new_residual = fused_add_rms_norm_triton(q, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(q, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, ref_residual, **_exact_tol(torch.bfloat16))
    torch.testing.assert_close(out, ref_out, **_tol(torch.bfloat16))


def test_rms_norm_triton_float32_weight_promotes():
    """`weight * normed` promotes like torch: fp32 weight on bf16 activations gives fp32."""
    x = _randn(3, 64, dtype=torch.bfloat16, seed=11)
    weight = _weight(64, torch.float32, seed=12)
    out = rms_norm_triton(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **_tol(torch.bfloat16))


def test_rms_norm_triton_bad_args():
    x = _randn(2, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm_triton(x, x.half(), torch.ones(64, device=DEVICE), 1e-6)
    assert rms_norm_triton(x[:0], torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)


# ---- RoPE -------------------------------------------------------------------------------------


def _qkv_views(num_tokens, q_heads, k_heads, head_dim, dtype, seed):
    """q, k, v as strided column slices of one [T, (Hq + 2 Hk) * D] QKV output."""
    q_size, kv_size = q_heads * head_dim, k_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, q_heads, k_heads", [(128, 7, 1), (64, 6, 2)])
def test_rotary_triton_matches_reference(dtype, head_dim, q_heads, k_heads):
    rope = RotaryEmbedding(head_dim, max_position=4096, rope_theta=1e6).to(DEVICE)
    positions = torch.randint(0, 4096, (9,), generator=torch.Generator().manual_seed(head_dim))
    positions = positions.to(DEVICE)
    qkv, q, k, v = _qkv_views(9, q_heads, k_heads, head_dim, dtype, seed=head_dim + q_heads)
    v_before = v.clone()
    q_exp, k_exp = _rotary_expected(rope, positions, q, k)

    q_out, k_out = apply_rotary_triton(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    tol = _exact_tol(dtype, contracted_fp32=True)
    torch.testing.assert_close(q, q_exp, **tol)
    torch.testing.assert_close(k, k_exp, **tol)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ref_matches_layer_exactly(dtype):
    rope = RotaryEmbedding(64, max_position=512, rope_theta=1e4)  # CPU: the layer's torch code
    positions = torch.tensor([0, 1, 17, 511, 3])
    _, q, k, _ = _qkv_views(5, 4, 2, 64, dtype, seed=13)
    q, k = q.cpu(), k.cpu()
    q_layer, k_layer = rope(positions, q, k)  # new tensors
    apply_rotary_ref(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
    assert torch.equal(q, q_layer) and torch.equal(k, k_layer)


def test_rotary_gptj_style():
    """GPT-J pairs (2i, 2i+1): the same rotation as neox on channels reordered evens-then-odds."""
    head_dim = 64
    rope = RotaryEmbedding(head_dim, max_position=256).to(DEVICE)
    positions = torch.tensor([5, 0, 255, 77, 128, 9, 31], device=DEVICE)
    _, q, k, _ = _qkv_views(7, 3, 1, head_dim, torch.float32, seed=14)
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)]).to(DEVICE)

    def by_heads(x):
        return x.reshape(7, -1, head_dim)

    q_neox = by_heads(q)[..., perm].reshape(7, -1)
    k_neox = by_heads(k)[..., perm].reshape(7, -1)
    apply_rotary_ref(positions, q_neox, k_neox, rope.cos_cache, rope.sin_cache, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(positions, q_ref, k_ref, rope.cos_cache, rope.sin_cache, head_dim, False)
    torch.testing.assert_close(by_heads(q_ref)[..., perm], by_heads(q_neox), atol=0, rtol=0)
    torch.testing.assert_close(by_heads(k_ref)[..., perm], by_heads(k_neox), atol=0, rtol=0)

    apply_rotary_triton(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim, False)
    torch.testing.assert_close(q, q_ref, **_tol(torch.float32))
    torch.testing.assert_close(k, k_ref, **_tol(torch.float32))


def test_rotary_triton_3d_inputs_and_bad_args():
    rope = RotaryEmbedding(64, max_position=64).to(DEVICE)
    positions = torch.tensor([3, 9, 63], device=DEVICE)
    q = _randn(3, 2, 64, dtype=torch.float32, seed=15)
    k = _randn(3, 1, 64, dtype=torch.float32, seed=16)
    q_exp, k_exp = _rotary_expected(rope, positions, q.view(3, -1), k.view(3, -1))
    apply_rotary_triton(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
    torch.testing.assert_close(
        q.view(3, -1), q_exp, **_exact_tol(torch.float32, contracted_fp32=True)
    )
    torch.testing.assert_close(
        k.view(3, -1), k_exp, **_exact_tol(torch.float32, contracted_fp32=True)
    )

    cos, sin = rope.cos_cache, rope.sin_cache
    with pytest.raises(NotImplementedError, match="partial rotary"):
        apply_rotary_triton(positions, q, k, cos[:, :16], sin[:, :16], 64)
    with pytest.raises(ValueError, match="share a dtype"):
        apply_rotary_triton(positions, q, k.half(), cos, sin, 64)
    with pytest.raises(ValueError, match="q must be"):
        apply_rotary_triton(positions[:2], q, k, cos, sin, 64)
    with pytest.raises(ValueError, match="contiguous"):
        apply_rotary_triton(positions, q.transpose(1, 2), k, cos, sin, 64)


# ---- SiLU-and-mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, inter", [(5, 300), (1, 1536)])
def test_silu_and_mul_triton(dtype, num_tokens, inter):
    x = _randn(num_tokens, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    expected = silu_and_mul_ref(x)
    assert torch.equal(SiluAndMul()(x.cpu()), silu_and_mul_ref(x.cpu()))  # layer's torch code
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tol(dtype))


def test_silu_and_mul_triton_strided_and_3d():
    base = _randn(4, 3 * 96, dtype=torch.bfloat16, seed=17)
    x = base[:, : 2 * 96]  # row stride 288: read in place
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **_tol(torch.bfloat16))
    x3 = _randn(2, 3, 2 * 40, dtype=torch.float32, seed=18)
    torch.testing.assert_close(silu_and_mul_triton(x3), silu_and_mul_ref(x3), **_tol(torch.float32))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(x3[..., :-1])


# ---- dispatchers ------------------------------------------------------------------------------


def test_dispatchers_use_reference_off_cuda_and_triton_on_cuda():
    x = _randn(3, 64, dtype=torch.bfloat16, seed=19)
    residual = _randn(3, 64, dtype=torch.bfloat16, seed=20)
    weight = _weight(64, torch.bfloat16, seed=21)
    rope = RotaryEmbedding(64, max_position=32).to(DEVICE)
    positions = torch.tensor([0, 5, 31], device=DEVICE)
    q, k = (
        _randn(3, 128, dtype=torch.bfloat16, seed=22),
        _randn(3, 64, dtype=torch.bfloat16, seed=23),
    )
    q_exp, k_exp = _rotary_expected(rope, positions, q, k)
    fused_ops.apply_rotary(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
    got = {
        "rms": (fused_ops.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)),
        "add": (
            fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)[0],
            fused_add_rms_norm_ref(x, residual, weight, 1e-6)[0],
        ),
        "silu": (fused_ops.silu_and_mul(x), silu_and_mul_ref(x)),
        "rope_q": (q, q_exp),
        "rope_k": (k, k_exp),
    }
    for name, (actual, expected) in got.items():
        if DEVICE == "cpu":  # the reference itself: bit-exact
            assert torch.equal(actual, expected), name
        else:
            torch.testing.assert_close(actual, expected, **_tol(torch.bfloat16), msg=name)


# ---- GPU: full Qwen2.5-7B shapes --------------------------------------------------------------

QWEN7B = {"hidden": 3584, "q_heads": 28, "k_heads": 4, "head_dim": 128, "inter": 18944}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_full_size(num_tokens, dtype):
    hidden, head_dim = QWEN7B["hidden"], QWEN7B["head_dim"]
    x = _randn(num_tokens, hidden, dtype=dtype, seed=30, scale=3.0)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=31, scale=10.0)
    weight = _weight(hidden, dtype, seed=32)
    torch.testing.assert_close(
        rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **_tol(dtype)
    )
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))

    rope = RotaryEmbedding(head_dim, max_position=32768, rope_theta=1e6).to(DEVICE)
    positions = torch.randint(0, 32768, (num_tokens,), device=DEVICE)
    _, q, k, _ = _qkv_views(num_tokens, QWEN7B["q_heads"], QWEN7B["k_heads"], head_dim, dtype, 33)
    q_exp, k_exp = _rotary_expected(rope, positions, q, k)
    apply_rotary_triton(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim)
    assert torch.equal(q, q_exp) and torch.equal(k, k_exp)

    gate_up = _randn(num_tokens, 2 * QWEN7B["inter"], dtype=dtype, seed=34, scale=3.0)
    torch.testing.assert_close(
        silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up), **_tol(dtype)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernels_capture_in_cuda_graph():
    """Decode runs inside a CUDA graph: each op must capture and replay on fresh inputs."""
    hidden, head_dim = QWEN7B["hidden"], QWEN7B["head_dim"]
    x = _randn(4, hidden, dtype=torch.bfloat16, seed=40)
    residual = _randn(4, hidden, dtype=torch.bfloat16, seed=41)
    weight = _weight(hidden, torch.bfloat16, seed=42)
    rope = RotaryEmbedding(head_dim, max_position=4096, rope_theta=1e6).to(DEVICE)
    positions = torch.tensor([0, 100, 4095, 7], device=DEVICE)
    qkv, q, k, _ = _qkv_views(4, 28, 4, head_dim, torch.bfloat16, seed=43)
    gate_up = _randn(4, 2 * 1024, dtype=torch.bfloat16, seed=44)

    def step():
        out, new_res = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        fused_ops.apply_rotary(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim)
        return out, new_res, fused_ops.silu_and_mul(gate_up)

    step()  # compile outside the capture
    qkv_start = qkv.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    x.copy_(_randn(4, hidden, dtype=torch.bfloat16, seed=45))
    gate_up.copy_(_randn(4, 2 * 1024, dtype=torch.bfloat16, seed=46))
    qkv.copy_(qkv_start)
    graph.replay()
    expected = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(outputs[0], expected[0], **_tol(torch.bfloat16))
    assert torch.equal(outputs[1], expected[1])
    torch.testing.assert_close(outputs[2], silu_and_mul_ref(gate_up), **_tol(torch.bfloat16))
    q_exp, k_exp = _rotary_expected(rope, positions, *qkv_start.split([28 * 128, 512, 512], -1)[:2])
    assert torch.equal(q, q_exp) and torch.equal(k, k_exp)

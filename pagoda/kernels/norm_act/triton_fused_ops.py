"""Triton kernels for the decoder's elementwise ops: RMSNorm (+ residual add), RoPE, SiLU-and-mul.

One launch per op replaces the 3-10 eager kernels of its torch reference in `reference.py`, whose
float32 math and casts to the model dtype each kernel repeats step for step, so bf16/fp16
results match eager torch (and Hugging Face) to the rounding of each step. Imported lazily by the
dispatchers in `reference.py`: `@triton.jit` reads TRITON_INTERPRET when this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.norm_act.reference import MAX_HIDDEN
from pagoda.kernels.pdl import pdl_launch_args

# float32 mantissa bits dropped when rounding to each model dtype (see `_round`).
_DROP_BITS = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}


def _drop_bits(dtype: torch.dtype) -> int:
    if dtype not in _DROP_BITS:
        raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    return _DROP_BITS[dtype]


@triton.jit
def _round(x, DROP: tl.constexpr):
    """float32 x rounded to nearest even with DROP fewer mantissa bits (bf16: 16, fp16: 13).

    Eager torch rounds each intermediate to the model dtype. `x.to(bf16).to(fp32)` would say the
    same, but the compiler folds that pair away (and then contracts products into FMAs), so the
    rounding is done on the bits. Also exact under the interpreter, whose bf16 casts truncate.
    fp16: values beyond its range are not clamped to inf (only the final store overflows).
    """
    if DROP > 0:
        bits = x.to(tl.int32, bitcast=True)
        # Add half an ulp minus one, plus the lowest kept bit (ties go to even), then truncate.
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (-(1 << DROP))
        rounded = bits.to(tl.float32, bitcast=True)
        if DROP == 13:  # fp16 subnormals (< 2^-14) are multiples of 2^-24: the ulp of [0.5, 1)
            tiny = (tl.abs(x) + 0.5) - 0.5
            rounded = tl.where(tl.abs(x) < 6.103515625e-05, tl.where(x < 0, -tiny, tiny), rounded)
        x = rounded
    return x


# The row count changes every step: specialized (== 1, % 16) it would compile mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    inner,  # rows are [outer, inner] of a 3-D input; inner = 1 for 2-D
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    IN_DROP: tl.constexpr,  # `_round` bits of the input dtype
    OUT_DROP: tl.constexpr,  # of the output dtype (float32 when the weight is)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
    PDL_EARLY: tl.constexpr = False,  # trigger the next launch first thing (pdl.py)
):
    if USE_PDL and PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < hidden
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    # Two strides so that strided 3-D views (Qwen3's per-head q/k norm on a slice of the fused
    # QKV output) are read in place instead of being copied first.
    x_rows = (rows // inner) * stride_xo + (rows % inner) * stride_xi
    out_offs = rows[:, None] * hidden + cols[None, :]  # outputs are contiguous
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_rows = (rows // inner) * stride_ro + (rows % inner) * stride_ri
        r = tl.load(res_ptr + r_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        # HF adds the residual in the model dtype: round the sum before normalising it.
        x = _round(x + r.to(tl.float32), IN_DROP)
        tl.store(res_out_ptr + out_offs, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    if USE_PDL and not PDL_EARLY:  # inputs read: the next kernel may launch (it still waits)
        tl.extra.cuda.gdc_launch_dependents()
    # Masked lanes are 0, so they add nothing to the sum of squares.
    var = tl.sum(x * x, axis=1) / hidden  # [BLOCK_M]
    rstd = tl.rsqrt(var + eps)
    # Cast back to the input dtype before the weight multiply, as HF's LlamaRMSNorm does.
    normed = _round(x * rstd[:, None], IN_DROP)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    out = _round(w[None, :] * normed, OUT_DROP)
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x as [outer, inner, H] with unit last stride, inner, outer stride, inner stride)."""
    if x.dim() != 3:
        x = x.reshape(-1, 1, x.shape[-1])  # a view whenever the leading dims allow one
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {list(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's maximum of {MAX_HIDDEN}")
    # Same promotion as `weight * normed` in torch (e.g. fp32 weight on a bf16 model -> fp32).
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    )
    num_rows = x.numel() // hidden
    if num_rows == 0:
        return out, res_out
    x3, inner, stride_xo, stride_xi = _as_rows(x)
    r3, _, stride_ro, stride_ri = _as_rows(residual) if residual is not None else (x3, 1, 0, 0)
    block_n = triton.next_power_of_2(hidden)
    # Narrow rows (per-head norms, D = 128) share a program so each still moves a few KiB.
    block_m = min(triton.next_power_of_2(num_rows), max(1, 2048 // block_n))
    num_warps = min(16, max(1, block_m * block_n // 512))
    grid = (triton.cdiv(num_rows, block_m),)
    _rms_norm_kernel[grid](
        x3,
        r3,
        weight,
        out,
        res_out if res_out is not None else out,  # unused without a residual
        num_rows,
        inner,
        stride_xo,
        stride_xi,
        stride_ro,
        stride_ri,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        IN_DROP=_drop_bits(x.dtype),
        OUT_DROP=_drop_bits(out.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **pdl_launch_args(x, early=True),
    )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] (2-D or a strided 3-D view) with weight [H]; returns a new tensor."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor,  # same shape and dtype as x
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the inputs are left untouched."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: got {list(residual.shape)} {residual.dtype}, "
            f"x is {list(x.shape)} {x.dtype}"
        )
    out, res_out = _launch_rms_norm(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


@triton.jit
def _rotate_heads(
    row_ptr,  # this token's q or k row
    head0,
    num_heads,
    cos,  # [1, HALF_PAD] float32, already rounded to the model dtype
    sin,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DROP: tl.constexpr,
):
    offs_i = tl.arange(0, HALF_PAD)  # [HALF_PAD] frequency index
    heads = head0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (heads < num_heads)[:, None] & (offs_i < HALF)[None, :]
    if IS_NEOX:  # rotate halves: pairs (i, i + D/2)
        off1 = offs_i
        off2 = offs_i + HALF
    else:  # GPT-J: interleaved pairs (2i, 2i + 1)
        off1 = 2 * offs_i
        off2 = 2 * offs_i + 1
    ptr1 = row_ptr + heads[:, None] * HEAD_DIM + off1[None, :]  # [BLOCK_H, HALF_PAD]
    ptr2 = row_ptr + heads[:, None] * HEAD_DIM + off2[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    # Eager torch rounds every product to the model dtype (HF: q * cos + rotate_half(q) * sin);
    # rounding each one here too makes bf16/fp16 results bit-identical to the layer's.
    o1 = _round(_round(x1 * cos, DROP) - _round(x2 * sin, DROP), DROP)
    o2 = _round(_round(x2 * cos, DROP) + _round(x1 * sin, DROP), DROP)
    tl.store(ptr1, o1.to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, o2.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_kt,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    num_q_tiles,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DROP: tl.constexpr,  # `_round` bits of q's dtype
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tok = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    # The layer (like HF) casts the float32 table rows to the model dtype before multiplying.
    cos = tl.load(cos_ptr + pos * stride_cos + offs_i, mask=offs_i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_i, mask=offs_i < HALF, other=0.0)
    cos = _round(cos.to(tl.float32), DROP)[None, :]  # [1, HALF_PAD]
    sin = _round(sin.to(tl.float32), DROP)[None, :]
    # Tiles [0, num_q_tiles) rotate q heads, the rest k heads: one launch covers both. Each
    # branch addresses its own tensor (rather than picking a pointer in the branch) so that the
    # compiler still knows the rows are 16-byte aligned and vectorises the loads.
    if tile < num_q_tiles:
        _rotate_heads(
            q_ptr + tok * stride_qt, tile * BLOCK_H, num_q_heads, cos, sin,
            HEAD_DIM, HALF, HALF_PAD, BLOCK_H, IS_NEOX, DROP,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr + tok * stride_kt, (tile - num_q_tiles) * BLOCK_H, num_k_heads, cos, sin,
            HEAD_DIM, HALF, HALF_PAD, BLOCK_H, IS_NEOX, DROP,
        )  # fmt: skip


def _rotary_rows(x: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> torch.Tensor:
    """x as a [T, H*D] view with unit inner stride; in-place updates need a view, never a copy."""
    if x.shape[0] != num_tokens or x[0].numel() % head_dim != 0:
        raise ValueError(f"{name} must be [{num_tokens}, heads * {head_dim}], got {list(x.shape)}")
    try:
        rows = x.view(num_tokens, -1)
    except RuntimeError as e:
        raise ValueError(f"{name} must be viewable as [T, heads * head_dim]: {e}") from e
    if rows.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride 1), got strides {x.stride()}")
    return rows


def apply_rotary_triton(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq*D] (or [T, Hq, D]); may be a strided view, e.g. of the QKV output
    k: torch.Tensor,  # [T, Hk*D]
    cos_cache: torch.Tensor,  # [max_position, D/2], as `RotaryEmbedding.cos_cache`
    sin_cache: torch.Tensor,  # [max_position, D/2]
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place at `positions` (< max_position, unchecked) and return them."""
    num_tokens = positions.shape[0]
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if cos_cache.shape != sin_cache.shape or cos_cache.dim() != 2:
        raise ValueError(
            f"cos/sin caches must both be [max_position, D/2], got {list(cos_cache.shape)} "
            f"and {list(sin_cache.shape)}"
        )
    if 2 * cos_cache.shape[1] != head_dim:
        raise NotImplementedError(
            f"rotary dim {2 * cos_cache.shape[1]} != head_dim {head_dim}: partial rotary "
            "embeddings are not supported"
        )
    if num_tokens == 0:
        return q, k
    q_rows = _rotary_rows(q, "q", num_tokens, head_dim)
    k_rows = _rotary_rows(k, "k", num_tokens, head_dim)
    cos_cache = cos_cache if cos_cache.stride(1) == 1 else cos_cache.contiguous()
    sin_cache = sin_cache if sin_cache.stride(1) == 1 else sin_cache.contiguous()
    num_q_heads = q_rows.shape[1] // head_dim
    num_k_heads = k_rows.shape[1] // head_dim
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    block_h = _rotary_block_h(num_tokens, num_q_heads + num_k_heads, half_pad)
    num_q_tiles = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_tiles + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        positions,
        q_rows,
        k_rows,
        cos_cache,
        sin_cache,
        q_rows.stride(0),
        k_rows.stride(0),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        num_q_tiles,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        IS_NEOX=is_neox,
        DROP=_drop_bits(q.dtype),
        num_warps=max(1, min(4, block_h * half_pad // 256)),  # ~8 pairs per thread
        **pdl_launch_args(q),
    )
    return q, k


def _rotary_block_h(num_tokens: int, num_heads: int, half_pad: int) -> int:
    """Heads per program: one for decode (spread the few bytes over many SMs), then more as T
    grows, up to 256 pairs per program (H200, T=8192: 4 heads of 128 at one warp beat 8 or 16
    heads at 2-4 warps by 20-35%)."""
    per_token = max(1, num_tokens * num_heads // 1024)
    return min(triton.next_power_of_2(per_token), max(1, 256 // half_pad))


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    inter,
    DROP: tl.constexpr,  # `_round` bits of the dtype
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
    PDL_EARLY: tl.constexpr = False,  # trigger the next launch first thing (pdl.py)
):
    if USE_PDL and PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    x_row = x_ptr + tok * stride_xt
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    # torch's silu formula in float32, rounded to the model dtype before the multiply by `up`
    # (F.silu and `*` are two eager ops in HF).
    act = _round(gate / (1.0 + tl.exp(-gate)), DROP)
    out = _round(act * up, DROP)
    tl.store(out_ptr + tok * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I] (gate first); returns [..., I]."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim must be even (gate | up), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])  # [T, 2I], a view for 2-D inputs
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_tokens = rows.shape[0]
    if num_tokens == 0 or inter == 0:
        return out
    # Small batches: short blocks so the few rows still spread over many SMs.
    block = min(triton.next_power_of_2(inter), 1024 if num_tokens >= 64 else 256)
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        rows.stride(0),
        inter,
        inter,
        DROP=_drop_bits(x.dtype),
        BLOCK=block,
        num_warps=4 if block >= 512 else 2,
        **pdl_launch_args(x, early=True),
    )
    return out

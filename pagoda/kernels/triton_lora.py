"""Triton segmented gather-matmul for LoRA: `out[t] (+)= x[t] @ w[slot(t)]^T` per segment.

One kernel serves both halves of a LoRA layer: "shrink" (x [T, in] by A [L, S*r, in]) and
"expand" (the rank-space result by B [L, out, S*r], accumulated into the base output). The grid
is (segment, token tile, output tile); a program whose segment has slot -1 exits at once, so
the grid is fixed by shapes alone and the launch is CUDA-graph safe.
Torch reference: `pagoda.kernels.lora.lora_sgmv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_sgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    N,
    K,
    stride_xt,
    stride_xk,
    stride_wl,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_on,
    ADD: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: full-precision dot, not TF32
    UPCAST: tl.constexpr,  # interpreter only: its numpy dot has no bfloat16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:  # no adapter for this segment (or a CUDA-graph padding row)
        return
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < end
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    w_base = w_ptr + slot.to(tl.int64) * stride_wl

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(b.dtype)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)

    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# TRITON_INTERPRET=1 at import time turns the kernel into an interpreted (numpy) function.
_INTERPRETED = not isinstance(_lora_sgmv_kernel, triton.runtime.JITFunction)


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def lora_sgmv_triton(
    x: torch.Tensor,  # [T, K]
    w: torch.Tensor,  # [L, N, K]
    seg_starts: torch.Tensor,  # [>= S+1] int32
    seg_slots: torch.Tensor,  # [>= S] int32
    num_segs: int,
    max_seg_len: int,
    out: torch.Tensor,  # [T, N]
    add: bool,
) -> torch.Tensor:
    """See `pagoda.kernels.lora.lora_sgmv`. `max_seg_len` bounds the token tiles per segment."""
    num_slots, n, k = w.shape
    assert x.shape[1] == k and out.shape[1] == n, (x.shape, w.shape, out.shape)
    if num_segs == 0 or x.shape[0] == 0:
        return out
    # tl.dot needs tiles of at least 16; a decode segment (one token) wastes the rest of the
    # M tile, which is cheap next to reading the weights.
    block_m = _block(max_seg_len, 16, 64)
    block_n = _block(n, 16, 64)
    block_k = _block(k, 16, 64)
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _lora_sgmv_kernel[grid](
        x,
        w,
        out,
        seg_starts,
        seg_slots,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        ADD=add,
        IEEE=w.dtype == torch.float32 or _INTERPRETED,
        UPCAST=_INTERPRETED and w.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

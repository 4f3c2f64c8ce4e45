"""Batch-1 GEMV over FP8 weights: y = x @ (w_q * s_w)^T (+ bias), x in bf16 / fp16.

At M = 1 a decode step reads each weight once; the FP8 weight halves those bytes against bf16,
and quantizing the one activation row would only add a launch (and its rounding). So the batch-1
layer of an FP8 checkpoint reads e4m3 weights, converts them in registers, multiplies by the
unquantized activation in fp32 and applies the per-channel (or per-tensor, expanded) weight
scale once per output in the epilogue. A program owns BLOCK_N rows (contiguous along K: 16-byte
loads of 16 e4m3 values), no split-K: the same tiling as the dense GEMV (`kernels/
triton_gemv.py`), with BLOCK_K doubled so a stage moves the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.fp8.triton_e4m3 import e4m3_bits_to_f32, needs_soft_e4m3
from pagoda.kernels.pdl import pdl_launch_args


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    N, K, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    SOFT_E4M3: tl.constexpr,  # w_ptr holds the codes as uint8 (no e4m3 conversion: sm_80 / 87)
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        if EVEN_N and EVEN_K:
            w = tl.load(rows + k[None, :])
            x = tl.load(x_ptr + k)
        else:
            w = tl.load(rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        if SOFT_E4M3:
            wf = e4m3_bits_to_f32(w)
        else:
            wf = w.to(tl.float32)
        acc += wf * x.to(tl.float32)[None, :]
    if USE_PDL:  # every weight tile is read: the next kernel may launch (it waits for us)
        tl.extra.cuda.gdc_launch_dependents()
    col = tl.sum(acc, 1) * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    if HAS_BIAS:
        col += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, col.to(out_ptr.dtype.element_ty), mask=mask_n)


def fp8_gemv(
    x: torch.Tensor,  # [1, K] bf16 / fp16
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride along K
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    block_n: int = 8,
    block_k: int = 1024,
    num_warps: int = 4,
    num_stages: int = 3,
    soft_e4m3: bool | None = None,  # None: where the GPU is below sm_89 (see triton_e4m3.py)
) -> torch.Tensor:  # [1, N] in x's dtype
    m, k = x.shape
    n = w_q.shape[0]
    if m != 1:
        raise ValueError(f"fp8_gemv handles M == 1, got M={m}")
    if w_q.shape[1] != k or w_q.stride(1) != 1 or w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w_q must be [N, {k}] e4m3 with unit stride along K")
    if w_scale.shape != (n,) or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be a float32 [{n}] tensor, got {list(w_scale.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    if soft_e4m3 is None:
        soft_e4m3 = needs_soft_e4m3(x.device)
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w_q.view(torch.uint8) if soft_e4m3 else w_q, w_scale,
        bias if bias is not None else w_scale, out,
        n, k, w_q.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        NUM_STAGES=num_stages,
        SOFT_E4M3=soft_e4m3,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out

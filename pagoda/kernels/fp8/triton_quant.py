"""FP8 activation quantization in one launch: per-token dynamic scales or one static scale.

One program per row: a first pass over the row finds max|x| (dynamic), a second writes
x / scale clamped to +-448 as e4m3 (the row is re-read from L2; rows are at most a few tens of
KB). The eager torch version is five kernels and three full passes over x; at batch 1-128 the
launches dominate. Output: x_q [M, K] float8_e4m3fn and, dynamic, the scales [M, 1] float32 that
`torch._scaled_mm` takes as its row-wise A scales. Needs Triton's fp8e4nv (sm_89+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.fp8.ops import FP8_DTYPE, FP8_MAX, MIN_SCALE
from pagoda.kernels.pdl import pdl_launch_args


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, s_in_ptr, K, stride_xm,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if DYNAMIC:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / FP8_MAX_C, MIN_SCALE_C)
    else:
        scale = tl.load(s_in_ptr)
    tl.store(s_ptr + row, scale)  # [M, 1]: the row-wise A scales of the FP8 GEMM
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        # div_rn: `/` on float32 is div.full.f32 (2 ulp), off torch's x / scale by one e4m3
        # code now and then (seen at K 18,944 on an H100)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * K + k0 + offs, q.to(tl.float8e4nv), mask=k0 + offs < K)


def quant_fp8_triton(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] e4m3, scale [M, 1] float32): per-token scales, or `static_scale` [1]
    repeated per row (cuBLASLt's row-wise scaling wants a contiguous [M, 1])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), device=x.device, dtype=FP8_DTYPE)
    dynamic = static_scale is None
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = min(4096, triton.next_power_of_2(k))
    if m:
        _quant_kernel[(m,)](
            x, q, scale, scale if dynamic else static_scale, k, x.stride(0),
            FP8_MAX_C=FP8_MAX,
            MIN_SCALE_C=MIN_SCALE,
            DYNAMIC=dynamic,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
            **pdl_launch_args(x),
        )  # fmt: skip
    return q, scale

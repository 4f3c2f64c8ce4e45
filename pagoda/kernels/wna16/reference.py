"""W4A16 / W8A16 torch references and the large-M rule of the Triton kernels.

`wna16_linear_ref` dequantizes and multiplies: the oracle of the Triton kernels and the CPU
path; `dequantize_packed_t` is the oracle of `wna16_dequant`, and `large_m_threshold` the M
from which the kernel registry sends a layer through it and cuBLAS instead of the Triton GEMM.
(Int32 packing lives in `pagoda.quant.packing`, `dequantize_weight` in `pagoda.quant.dequant`.)
"""

from __future__ import annotations

import math

import torch

from pagoda.quant.dequant import dequantize_weight
from pagoda.quant.packing import unpack_from_int32


def wna16_linear_ref(
    x: torch.Tensor,  # [M, in]
    qweight: torch.Tensor,  # [out, in] int8
    scale: torch.Tensor,  # [out, num_groups]
    zero_point: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, out]
    """Reference quantized linear: dequantize in float32, matmul, cast to x's dtype."""
    w = dequantize_weight(qweight, scale, zero_point, group_size, g_idx, torch.float32)
    out = x.to(torch.float32) @ w.t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def dequantize_packed_t(
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32, packed along K (the kernels' layout)
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (2^(bits-1) + zero point), None when symmetric
    group_size: int,  # <= 0 or >= k: per output channel
    bits: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """Torch reference of `wna16_dequant`: the dense [N, K] weight from the kernels' inputs.

    Same arithmetic as `dequantize_weight` (which it calls): (u - zero) * scale in float32,
    then one cast to `dtype`. With u and zero small integers and a bf16 / fp16 scale the fp32
    product is exact, so the result is the correctly rounded (nearest-even) weight.
    """
    offset = 1 << (bits - 1)
    q = unpack_from_int32(qweight_t, bits, k, packed_dim=0).t()  # [N, K] signed codes
    zp = None if zeros_t is None else zeros_t.t().to(torch.float32) - offset
    group = k if group_size <= 0 or group_size >= k else group_size
    return dequantize_weight(q, scales_t.t(), zp, group, dtype=dtype).contiguous()


# ---------------------------------------------------------------- large-M rule
#
# For M > 16 a layer in the packed layout runs the Triton dequant-GEMM (`wna16_gemm`) or expands
# the weight into a dense scratch (`wna16_dequant`, one bandwidth-bound pass) for cuBLAS. Two
# regimes decide (the H200 measurements behind them are in BENCHMARKS.md):
# 1. The GEMM fills the GPU: per weight the dequant pass costs (bits/8 + 2) B at _DEQUANT_BW,
#    the slower GEMM loses 2*M flop * (1/_TRITON_GEMM_FLOPS - 1/_CUBLAS_BF16_FLOPS): N*K
#    cancels, and dequant + cuBLAS wins from M = 140 for 4 bits (168 for 8).
# 2. The GEMM underfills the GPU (fewer column tiles than SMs): dequant + cuBLAS wins from the
#    first M past the GEMV, except on narrow short-K layers with a tuned GEMM config, whose
#    dequant pass measured slow: they switch at M = 1024.

_DEQUANT_BW = 3.5e12  # B/s the dequant pass is assumed to reach (H200 HBM3e: 4.8 peak)
_TRITON_GEMM_FLOPS = 243e12  # Triton dequant-GEMM at M = 256 (gate_up), H200
_CUBLAS_BF16_FLOPS = 640e12  # cuBLAS bf16 at M = 256 (gate_up), H200
_GEMM_BLOCK_N = 64  # the tuned GEMM configs' column tile for M = 32 ... 256
_FIRST_M_PAST_GEMV = 17
_NARROW_SHORT_K_M = 1024  # qkv / o_proj-like layers (see above)


def large_m_threshold(n: int, k: int, bits: int, num_sms: int, gemm_tuned: bool = False) -> int:
    """The smallest M from which dequant + cuBLAS beats the Triton GEMM (see the notes above);
    gemm_tuned: the GEMM has a measured config for this shape on this GPU."""
    bytes_per_weight = bits / 8 + 2
    compute_m = bytes_per_weight / (
        2 * _DEQUANT_BW * (1 / _TRITON_GEMM_FLOPS - 1 / _CUBLAS_BF16_FLOPS)
    )
    if -(-n // _GEMM_BLOCK_N) < num_sms:
        narrow_short_k = k < 2 * n and gemm_tuned
        return _NARROW_SHORT_K_M if narrow_short_k else _FIRST_M_PAST_GEMV
    return max(_FIRST_M_PAST_GEMV, math.ceil(compute_m))

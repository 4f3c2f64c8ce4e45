"""FP8 linear math in torch: activation quantization, the reference GEMM and `torch._scaled_mm`.

Activations are quantized symmetric e4m3: per token (scale = max|x_row| / 448, dynamic) or with
one calibrated per-tensor scale (static). The GEMM is y = (x_q * s_x) @ (w_q * s_w)^T computed
with fp32 accumulation; `scaled_mm` runs it on cuBLASLt's FP8 tensor cores (sm_89 / sm_90),
`scaled_mm_ref` in fp32 on any device (the oracle of the GPU tests).
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest per-token scale: an all-zero row still divides by something finite (vLLM's bound).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] e4m3, scale [M, 1] float32) with scale = max|x_row| / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def static_quant_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_q [M, K] e4m3 of x with the per-tensor `scale` [1] (float32)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scaled_mm_ref(
    x_q: torch.Tensor,  # [M, K] e4m3
    x_scale: torch.Tensor,  # [M, 1] or [1] float32
    w_q: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """The FP8 GEMM in fp32 (exact products of the e4m3 values), rounded once to `out_dtype`."""
    y = (x_q.float() @ w_q.float().t()) * x_scale.float().reshape(-1, 1) * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_gemv_ref(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp32 x @ (w_q * s)^T (+ bias) rounded to x's dtype."""
    y = (x.float() @ w_q.float().t()) * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm(
    x_q: torch.Tensor,  # [M, K] e4m3, row-major
    x_scale: torch.Tensor,  # [M, 1] float32
    w_q: torch.Tensor,  # [N, K] e4m3, row-major (its transpose is the column-major B)
    w_scale_row: torch.Tensor,  # [1, N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """cuBLASLt FP8 GEMM with row-wise scales (one per token, one per output channel)."""
    if bias is not None and not _bias_supported(x_q.device.index or 0, out_dtype):
        y = torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale_row, out_dtype=out_dtype
        )
        return y + bias
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale_row, bias=bias, out_dtype=out_dtype
    )


@functools.cache
def _bias_supported(index: int, out_dtype: torch.dtype) -> bool:
    """Whether this torch's row-wise `_scaled_mm` takes a bias (its epilogue add): tried once on
    a 16 x 16 problem; older builds reject it, then the bias is a separate add."""
    device = torch.device("cuda", index)
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    s = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(
            a,
            a.t(),
            scale_a=s,
            scale_b=s.t().contiguous(),
            bias=torch.zeros(16, device=device, dtype=out_dtype),
            out_dtype=out_dtype,
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def scaled_mm_available() -> bool:
    """Whether this torch build has the FP8 GEMM entry point."""
    return hasattr(torch, "_scaled_mm")

"""Fused elementwise ops of a decoder layer: RMSNorm (+ residual add), RoPE and SiLU-and-mul.

Each op has a torch reference (`*_ref`: Hugging Face's float32 math and casts, op for op) and a
dispatcher (`rms_norm`, ...) that runs the one-launch Triton kernel of `triton_fused_ops.py` on
CUDA tensors and the reference elsewhere. Unfused, these ops cost ~20 small kernels per layer,
which dominates batch-1 decode inside a CUDA graph.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pagoda.kernels.norm_act.reference import (
    apply_rotary_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from pagoda.platform import triton_available


@functools.cache
def _triton_ops() -> ModuleType | None:
    """The Triton module, or None when Triton is not installed.

    Imported on first use, not at import time: CPU-only installs need no Triton, and the JIT
    decorator reads TRITON_INTERPRET only when the kernel module is imported.
    """
    if not triton_available():
        return None
    from pagoda.kernels.norm_act import triton_fused_ops

    return triton_fused_ops


# ---- dispatchers: Triton on CUDA, the reference elsewhere ----------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H]; a new tensor."""
    ops = _triton_ops() if x.is_cuda else None
    if ops is not None and x.shape[-1] <= ops.MAX_HIDDEN:
        return ops.rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); new tensors, inputs untouched."""
    ops = _triton_ops() if x.is_cuda else None
    if (
        ops is not None
        and x.shape[-1] <= ops.MAX_HIDDEN
        and residual.shape == x.shape
        and residual.dtype == x.dtype
    ):
        return ops.fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq*D] and k [T, Hk*D] in place (views are fine); returns (q, k)."""
    ops = _triton_ops() if q.is_cuda else None
    if ops is not None:
        return ops.apply_rotary_triton(positions, q, k, cos_cache, sin_cache, head_dim, is_neox)
    return apply_rotary_ref(positions, q, k, cos_cache, sin_cache, head_dim, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] -> [..., I]."""
    ops = _triton_ops() if x.is_cuda else None
    if ops is not None:
        return ops.silu_and_mul_triton(x)
    return silu_and_mul_ref(x)

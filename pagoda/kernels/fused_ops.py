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
import torch.nn.functional as F

from pagoda.platform import triton_available

# Widest row the Triton RMSNorm kernel takes: it holds a whole row in registers; wider rows use
# the reference.
MAX_HIDDEN = 8192


@functools.cache
def _triton_ops() -> ModuleType | None:
    """The Triton module, or None when Triton is not installed.

    Imported on first use, not at import time: CPU-only installs need no Triton, and the JIT
    decorator reads TRITON_INTERPRET only when the kernel module is imported.
    """
    if not triton_available():
        return None
    from pagoda.kernels import triton_fused_ops

    return triton_fused_ops


# ---- references -------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise x [..., H] in float32, cast back, then scale by weight [H]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is taken in the model dtype, as in HF."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def apply_rotary_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq*D]
    k: torch.Tensor,  # [T, Hk*D]
    cos_cache: torch.Tensor,  # [max_position, D/2] float32
    sin_cache: torch.Tensor,  # [max_position, D/2] float32
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (and return them) as `RotaryEmbedding.forward` computes it.

    Neox style pairs element i with i + D/2 (HF rotate_half); GPT-J style pairs 2i with 2i + 1.
    """
    num_tokens = positions.shape[0]
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    for x in (q, k):
        heads = x.view(num_tokens, -1, head_dim)  # [T, H, D], shares storage with x
        if is_neox:
            x1, x2 = heads.chunk(2, dim=-1)
        else:
            x1, x2 = heads[..., 0::2], heads[..., 1::2]
        o1 = x1 * cos - x2 * sin  # new tensors: x1/x2 are read in full before the copy below
        o2 = x2 * cos + x1 * sin
        rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        heads.copy_(rotated)
    return q, k


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [..., 2I] = [gate | up] (the order of `gate_up_proj`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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

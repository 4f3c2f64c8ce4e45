"""Torch references of the fused elementwise ops of a decoder layer: RMSNorm (+ residual add),
RoPE and SiLU-and-mul, in Hugging Face's float32 math and casts, op for op.

The Triton kernels of `triton_fused_ops.py` are tested against these; `ops.py` dispatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Widest row the Triton RMSNorm kernel takes: it holds a whole row in registers; wider rows use
# the reference.
MAX_HIDDEN = 8192


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

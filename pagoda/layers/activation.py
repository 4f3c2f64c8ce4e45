"""Gated activations of the MLP.

`SiluAndMul` takes the fused gate_up projection output `[T, 2 * I]` (gate first, as in
`gate_up_proj`) and returns `silu(gate) * up` `[T, I]`, the SwiGLU of Llama and Qwen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.norm_act import ops as fused_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :I]) * x[..., I:]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if x.is_cuda:  # fused Triton kernel
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

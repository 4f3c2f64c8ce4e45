"""RMSNorm, optionally fused with the residual add that precedes it.

Matches Hugging Face's LlamaRMSNorm: normalise in float32, cast back to the input dtype, then
scale by the weight. The fused form adds the residual in the input dtype first (as HF's decoder
layer does) and returns the sum as the next residual, saving one pass over the activations.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.norm_act import ops as fused_ops


class RMSNorm(nn.Module):
    """`forward(x)` -> normed x; `forward(x, residual)` -> (normed x + residual, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype()),
            requires_grad=False,
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # one fused Triton kernel instead of ~7 elementwise ones
            if residual is None:
                return fused_ops.rms_norm(x, self.weight, self.eps)
            return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

"""What a quantized weight means: w = (q - zero_point) * scale per group, in torch.

The format's semantics, shared by the checkpoint formats, the runtime's torch path (the
reference of every W4A16 kernel) and the quantizer.
"""

from __future__ import annotations

import torch


def expand_groups(
    per_group: torch.Tensor, in_features: int, group_size: int, g_idx: torch.Tensor | None
) -> torch.Tensor:
    """[out, num_groups] -> [out, in_features]: each input column gets its group's value."""
    if g_idx is not None:
        return per_group[:, g_idx.long()]
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_weight(
    qweight: torch.Tensor,  # [out, in] int8 signed values
    scale: torch.Tensor,  # [out, num_groups]
    zero_point: torch.Tensor | None,  # [out, num_groups] int8, None when symmetric
    group_size: int,  # in_features for per-channel
    g_idx: torch.Tensor | None = None,  # [in] group of each input column (act-order "group")
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [out, in]
    """w = (q - zero_point) * scale, in `dtype` (default: the scale's dtype)."""
    dtype = dtype or scale.dtype
    in_features = qweight.shape[1]
    q = qweight.to(torch.float32)
    if zero_point is not None:
        q = q - expand_groups(zero_point.to(torch.float32), in_features, group_size, g_idx)
    w = q * expand_groups(scale.to(torch.float32), in_features, group_size, g_idx)
    return w.to(dtype)

"""A quantized weight's description and forms: `WeightQuantArgs` (bits, symmetry, group size,
act-order), `UnpackedWeight` (the canonical form every checkpoint format unpacks to and the
runtime layer repacks from) and `QuantizedWeight` (codes and per-group parameters, what a
quantizer produces and a format packs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.quant.dequant import dequantize_weight


@dataclass(frozen=True)
class WeightQuantArgs:
    """How a weight is quantized: integer bits, symmetry, group size (-1: per output channel).

    actorder: None, "static" / "weight" (columns quantized in activation order, groups kept in
    the original column order: no g_idx stored) or "group" / "dynamic" (groups follow the
    activation order: a `g_idx` tensor maps each input column to its group).
    """

    num_bits: int = 4
    symmetric: bool = True
    group_size: int = 128
    actorder: str | None = None

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ValueError(f"num_bits={self.num_bits} is not supported; use 4 or 8")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 (per channel) or >= 1, got {self.group_size}")
        if self.actorder not in (None, "static", "weight", "group", "dynamic"):
            raise ValueError(f"actorder={self.actorder!r} is not supported")

    @property
    def q_min(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def q_max(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    @property
    def has_g_idx(self) -> bool:
        return self.actorder in ("group", "dynamic")

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass
class UnpackedWeight:
    """A module's weights in one canonical form, whatever the checkpoint format."""

    codes: torch.Tensor  # [out, in] int8, signed values
    scale: torch.Tensor  # [out, groups] float
    zero_point: torch.Tensor | None  # [out, groups] int16 signed; None when symmetric
    g_idx: torch.Tensor | None  # [in] group of each input column; None when contiguous


@dataclass
class QuantizedWeight:
    """A quantized [out, in] weight: signed integer codes and per-group parameters."""

    qweight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, groups] in the storage dtype
    zero_point: torch.Tensor | None  # [out, groups] int8; None when symmetric
    group_size: int  # columns per group (in_features when per channel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        return dequantize_weight(
            self.qweight, self.scale, self.zero_point, self.group_size, dtype=dtype
        )

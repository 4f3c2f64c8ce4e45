"""Checkpoint formats, one module each: compressed-tensors (pack-quantized write/read, naive
read), legacy GPTQ (read; pack for tests), AutoAWQ GEMM (read/write).

Each module states the parameters a quantized linear layer holds in its format (`param_specs`)
and unpacks them to the canonical `pagoda.quant.scheme.UnpackedWeight` (`unpack_params`);
`format_module` picks the module of a checkpoint format name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

_MODULES = {
    "pack-quantized": "compressed_tensors",
    "naive-quantized": "compressed_tensors",
    "gptq": "gptq_legacy",
    "gptq_v2": "gptq_legacy",
    "awq-gemm": "autoawq",
}


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint tensor of a quantized linear layer, as the layer registers it."""

    name: str  # relative to the module (weight_packed, qweight, ...)
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: the model dtype
    output_dim: int | None  # the axis split by output shard (None: not split)
    output_pack: int = 1  # output features per stored element along output_dim


def check_zero_point_packing(out_features_per_shard: list[int], factor: int) -> None:
    """Zero points packed `factor` per word along the output are split by shard only whole."""
    if any(o % factor for o in out_features_per_shard):
        raise ValueError(
            f"output sizes {out_features_per_shard} are not multiples of {factor}, so packed "
            "zero points cannot be split by shard"
        )


def format_module(fmt: str) -> ModuleType:
    """The module that knows checkpoint format `fmt` (`param_specs`, `unpack_params`)."""
    if fmt not in _MODULES:
        raise ValueError(
            f"unknown quantized checkpoint format {fmt!r}; known: {', '.join(_MODULES)}"
        )
    return importlib.import_module(f"pagoda.quant.formats.{_MODULES[fmt]}")

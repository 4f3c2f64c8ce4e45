"""AutoAWQ GEMM checkpoints (`quant_method: awq`, `version: gemm`): read and write.

Per module: `qweight` int32 [in, out / 8] and `qzeros` int32 [in / G, out / 8] hold unsigned
4-bit values packed along the output dim in AutoAWQ's nibble order (`AWQ_ORDER`: nibble i of a
word holds output column AWQ_ORDER[i] of its 8), `scales` fp16 [in / G, out]; w = (q - z) * s.
Unpacking gives the canonical form the runtime layer repacks: signed int8 codes [out, in],
scales [out, groups] and int16 signed zero points [out, groups] (code and zero minus 8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.quant.formats import ParamSpec
from pagoda.quant.weights import UnpackedWeight, WeightQuantArgs

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word -> output column within the word
_AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column -> nibble
BITS = 4
_OFFSET = 1 << (BITS - 1)  # unsigned u = signed q + 8
PARAM_NAMES = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class AWQConfig:
    """What a checkpoint's `quantization_config` says about its AutoAWQ weights."""

    group_size: int  # -1: one group per output channel (AutoAWQ's q_group_size = -1)
    zero_point: bool
    version: str  # "gemm"
    modules_to_not_convert: tuple[str, ...]

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def parse_awq_config(qc: Mapping[str, Any]) -> AWQConfig:
    """Read an AutoAWQ `quantization_config` (transformers' `bits`/`group_size` spelling or
    AutoAWQ's own `w_bit`/`q_group_size`); one clear error for each unsupported field."""
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != BITS:
        raise ValueError(f"AutoAWQ checkpoint has w_bit={bits}; pagoda loads 4-bit AWQ only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"AutoAWQ version={version!r} is not supported; pagoda loads the 'gemm' layout "
            "(re-save the model with version='GEMM')"
        )
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group != -1 and group < 1:
        raise ValueError(f"AutoAWQ group_size must be -1 or >= 1, got {group}")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return AWQConfig(group, bool(qc.get("zero_point", True)), version, ignore)


def quantization_config(
    group_size: int = 128, zero_point: bool = True, modules_to_not_convert: list[str] | None = None
) -> dict[str, Any]:
    """config.json's `quantization_config` as AutoAWQ 0.2.9 writes it for version GEMM."""
    return {
        "quant_method": "awq",
        "zero_point": zero_point,
        "group_size": group_size,
        "bits": BITS,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


def _pack_columns(unsigned: torch.Tensor) -> torch.Tensor:
    """[rows, cols] values in 0..15 -> [rows, cols / 8] int32 words in AWQ order."""
    rows, cols = unsigned.shape
    grouped = unsigned.to(torch.int64).view(rows, cols // 8, 8)  # [rows, words, column]
    by_nibble = grouped[..., list(AWQ_ORDER)]  # [rows, words, nibble]
    shifts = torch.arange(8, device=unsigned.device, dtype=torch.int64) * BITS
    words = (by_nibble << shifts).sum(dim=-1)  # < 2^32, fields do not overlap
    return (words - ((words >> 31) << 32)).to(torch.int32)  # low 32 bits as signed int32


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 in AWQ order -> [rows, words * 8] int16 values in 0..15."""
    shifts = torch.tensor(_AWQ_COLUMN_NIBBLE, device=packed.device, dtype=torch.int32) * BITS
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [rows, words, column]
    return fields.reshape(packed.shape[0], -1).to(torch.int16)


def pack_awq_gemm(
    codes: torch.Tensor,  # [out, in] signed codes in -8..7
    scales: torch.Tensor,  # [out, groups]
    zeros: torch.Tensor | None,  # [out, groups] signed zero points in -8..7; None: symmetric
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # qweight, qzeros, scales
    """AutoAWQ GEMM tensors of one module: qweight [in, out / 8], qzeros [groups, out / 8]
    (int32), scales [groups, out] in `scale_dtype`. Symmetric weights get the midpoint zero."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    if out_features % 8:
        raise ValueError(f"AutoAWQ packing needs out_features % 8 == 0, got {out_features}")
    if scales.shape[0] != out_features or in_features % groups:
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)}"
        )
    if zeros is None:
        zeros = torch.zeros(out_features, groups, dtype=torch.int16, device=codes.device)
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} differ")
    for name, t in (("codes", codes), ("zeros", zeros)):
        if t.numel() and (int(t.min()) < -_OFFSET or int(t.max()) >= _OFFSET):
            raise ValueError(f"{name} must lie in -8..7 for 4-bit AutoAWQ packing")
    qweight = _pack_columns((codes.to(torch.int16) + _OFFSET).t().contiguous())
    qzeros = _pack_columns((zeros.to(torch.int16) + _OFFSET).t().contiguous())
    return qweight, qzeros, scales.t().to(scale_dtype).contiguous()


def unpack_awq_gemm(
    qweight: torch.Tensor,  # [in, out / 8] int32
    qzeros: torch.Tensor,  # [groups, out / 8] int32
    scales: torch.Tensor,  # [groups, out]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 [out, in], scales [out, groups], zeros int16 [out, groups]): signed, so
    that w = (codes - zeros) * scales."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(
            f"AutoAWQ qweight / qzeros must be int32, got {qweight.dtype} / {qzeros.dtype}"
        )
    in_features, words = qweight.shape
    groups, out_features = scales.shape
    if out_features != words * 8 or qzeros.shape != (groups, words):
        raise ValueError(
            f"AutoAWQ tensors do not fit together: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} (expected qweight [in, out/8], "
            "qzeros [in/G, out/8], scales [in/G, out])"
        )
    if in_features % groups:
        raise ValueError(
            f"AutoAWQ scales have {groups} groups, which does not divide in_features {in_features}"
        )
    codes = (_unpack_columns(qweight) - _OFFSET).t().to(torch.int8).contiguous()
    zeros = (_unpack_columns(qzeros) - _OFFSET).t().contiguous()
    return codes, scales.t().contiguous(), zeros


def param_specs(
    fmt: str, args: WeightQuantArgs, in_features: int, out_features_per_shard: list[int]
) -> list[ParamSpec]:
    """The tensors an AutoAWQ GEMM layer loads: [in, out] layouts packed along the output."""
    if args.num_bits != BITS:
        raise ValueError(f"AutoAWQ checkpoints are 4-bit, got num_bits={args.num_bits}")
    group = args.group_size_for(in_features)
    if in_features % group:
        raise ValueError(f"AutoAWQ group_size={group} does not divide in_features={in_features}")
    if any(o % 8 for o in out_features_per_shard):
        raise ValueError(
            f"AutoAWQ packs 8 output columns per int32; output sizes {out_features_per_shard} "
            "are not multiples of 8"
        )
    out, groups = sum(out_features_per_shard), in_features // group
    return [
        ParamSpec("qweight", (in_features, out // 8), torch.int32, 1, 8),
        ParamSpec("qzeros", (groups, out // 8), torch.int32, 1, 8),
        ParamSpec("scales", (groups, out), None, 1),
    ]


def unpack_params(
    fmt: str,
    tensors: dict[str, torch.Tensor],
    args: WeightQuantArgs,
    in_features: int,
    out_features: int,
) -> UnpackedWeight:
    """The canonical weight of an AutoAWQ GEMM layer (zero points dropped when all are the
    midpoint: such a layer is symmetric and takes the symmetric kernels)."""
    codes, scales, zeros = unpack_awq_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"])
    return UnpackedWeight(codes, scales, zeros if bool(zeros.any()) else None, None)

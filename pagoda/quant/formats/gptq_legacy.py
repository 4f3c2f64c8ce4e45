"""Legacy GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`): read, and pack for tests.

Per module: `qweight` int32 [in / f, out] (unsigned codes packed along the input dim), `qzeros`
int32 [groups, out / f] (packed along the output dim), `scales` [groups, out], `g_idx` int32
[in]. Format v1 (`checkpoint_format: gptq`, the default) stores zero - 1, the AutoGPTQ
off-by-one: w = s * (u - (z + 1)); v2 stores z itself. Serving goes through `WNA16LinearMethod`.
"""

from __future__ import annotations

import math

import torch

from pagoda.quant.formats import ParamSpec, check_zero_point_packing
from pagoda.quant.packing import pack_factor, pack_to_int32, unpack_from_int32
from pagoda.quant.weights import QuantizedWeight, UnpackedWeight, WeightQuantArgs


def param_specs(
    fmt: str, args: WeightQuantArgs, in_features: int, out_features_per_shard: list[int]
) -> list[ParamSpec]:
    """The tensors a legacy GPTQ layer loads: [in, out] layouts, output along dim 1."""
    f = pack_factor(args.num_bits)
    out = sum(out_features_per_shard)
    groups = math.ceil(in_features / args.group_size_for(in_features))
    check_zero_point_packing(out_features_per_shard, f)
    return [
        ParamSpec("qweight", (math.ceil(in_features / f), out), torch.int32, 1),
        ParamSpec("qzeros", (groups, out // f), torch.int32, 1, f),
        ParamSpec("scales", (groups, out), None, 1),
        ParamSpec("g_idx", (in_features,), torch.int32, None),
    ]


def unpack_params(
    fmt: str,
    tensors: dict[str, torch.Tensor],
    args: WeightQuantArgs,
    in_features: int,
    out_features: int,
) -> UnpackedWeight:
    """The canonical weight of a legacy GPTQ layer (v1 `gptq` or `gptq_v2`)."""
    bits = args.num_bits
    # Unsigned codes u in [0, 2^b): unpacking subtracts 2^(b-1), so q = u - 2^(b-1).
    q = unpack_from_int32(tensors["qweight"], bits, in_features, 0).t()
    z = unpack_from_int32(tensors["qzeros"], bits, out_features, 1).t().to(torch.int16)
    # GPTQ v1 stores zero - 1 (the AutoGPTQ off-by-one); v2 stores the zero itself.
    zp = z + 1 if fmt == "gptq" else z
    if not bool(zp.any()):
        zp = None  # symmetric: every zero point is the midpoint
    return UnpackedWeight(q.contiguous(), tensors["scales"].t(), zp, tensors["g_idx"])


def unpack_gptq(
    tensors: dict[str, torch.Tensor], num_bits: int, group_size: int, version: str = "gptq"
) -> tuple[QuantizedWeight, torch.Tensor]:
    """(QuantizedWeight with signed codes, g_idx [in]) of one legacy GPTQ module."""
    offset = 1 << (num_bits - 1)
    scales = tensors["scales"]  # [groups, out]
    out_features = scales.shape[1]
    g_idx = tensors["g_idx"].to(torch.int64)
    in_features = g_idx.numel()
    # unpack subtracts the offset: signed code q = u - offset.
    q = unpack_from_int32(tensors["qweight"], num_bits, in_features, 0).t()  # [out, in]
    z = unpack_from_int32(tensors["qzeros"], num_bits, out_features, 1).t().to(torch.int16)
    zero = z + 1 if version == "gptq" else z  # signed zero point (u-space zero - offset)
    qw = QuantizedWeight(q.contiguous(), scales.t().contiguous(), zero.contiguous(), group_size)
    del offset
    return qw, g_idx


def pack_gptq(
    qw: QuantizedWeight, g_idx: torch.Tensor, num_bits: int, version: str = "gptq"
) -> dict[str, torch.Tensor]:
    """Legacy GPTQ tensors of a QuantizedWeight (symmetric weights get the midpoint zero)."""
    out_features, _ = qw.qweight.shape
    zero = qw.zero_point
    if zero is None:
        zero = torch.zeros_like(qw.scale, dtype=torch.int16)
    stored = zero.to(torch.int16) - (1 if version == "gptq" else 0)
    return {
        "qweight": pack_to_int32(qw.qweight.t().contiguous(), num_bits, packed_dim=0),
        "qzeros": pack_to_int32(stored.t().contiguous().to(torch.int8), num_bits, packed_dim=1),
        "scales": qw.scale.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }

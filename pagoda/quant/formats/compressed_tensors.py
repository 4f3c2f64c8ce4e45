"""compressed-tensors checkpoints: `pack-quantized` write and read, `naive-quantized` read.

Per quantized module `m` (HF name): `m.weight_packed` int32 [out, in / f] (f = 32 / bits codes
per word along the input dim), `m.weight_scale` [out, groups] in the model dtype,
`m.weight_shape` int64 [2], for asymmetric schemes `m.weight_zero_point` int32 [out / f, groups]
(packed along the output dim), and `m.weight_g_idx` int32 [in] for act-order "group" only.
Writing the files is the quantizer's (`pagoda.quantizer.checkpoint`).
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
    """The tensors a layer of format `fmt` ("pack-quantized" / "naive-quantized") loads."""
    f = pack_factor(args.num_bits)
    out = sum(out_features_per_shard)
    groups = math.ceil(in_features / args.group_size_for(in_features))
    if fmt == "pack-quantized":
        if not args.symmetric:
            check_zero_point_packing(out_features_per_shard, f)
        specs = [
            ParamSpec("weight_packed", (out, math.ceil(in_features / f)), torch.int32, 0),
            ParamSpec("weight_scale", (out, groups), None, 0),
            # [out, in] of the checkpoint; one shape per HF module, so not split by shard.
            ParamSpec("weight_shape", (2,), torch.int64, None),
        ]
        if not args.symmetric:
            specs.append(ParamSpec("weight_zero_point", (out // f, groups), torch.int32, 0, f))
    elif fmt == "naive-quantized":
        specs = [
            ParamSpec("weight", (out, in_features), torch.int8, 0),
            ParamSpec("weight_scale", (out, groups), None, 0),
        ]
        if not args.symmetric:
            specs.append(ParamSpec("weight_zero_point", (out, groups), torch.int8, 0))
    else:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported")
    if args.has_g_idx:
        specs.append(ParamSpec("weight_g_idx", (in_features,), torch.int32, None))
    return specs


def unpack_params(
    fmt: str,
    tensors: dict[str, torch.Tensor],
    args: WeightQuantArgs,
    in_features: int,
    out_features: int,
) -> UnpackedWeight:
    """The canonical weight of a layer from its loaded `param_specs` tensors."""
    zp = None
    if fmt == "pack-quantized":
        q = unpack_from_int32(tensors["weight_packed"], args.num_bits, in_features, 1)
        if not args.symmetric:
            zp = unpack_from_int32(tensors["weight_zero_point"], args.num_bits, out_features, 0)
    else:
        q = tensors["weight"].to(torch.int8)
        if not args.symmetric:
            zp = tensors["weight_zero_point"]
    g_idx = tensors.get("weight_g_idx") if args.has_g_idx else None
    zp = None if zp is None else zp.to(torch.int16)
    return UnpackedWeight(q, tensors["weight_scale"], zp, g_idx)


def compress(
    qw: QuantizedWeight,
    args: WeightQuantArgs,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one module (names relative to the module)."""
    out_features, in_features = qw.qweight.shape
    tensors = {
        "weight_packed": pack_to_int32(qw.qweight, args.num_bits, packed_dim=1),
        "weight_scale": qw.scale.to(dtype).contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if qw.zero_point is not None:
        if out_features % pack_factor(args.num_bits):
            raise ValueError(
                f"asymmetric packing needs out_features ({out_features}) to be a multiple of "
                f"{pack_factor(args.num_bits)}"
            )
        tensors["weight_zero_point"] = pack_to_int32(qw.zero_point, args.num_bits, packed_dim=0)
    return tensors


def decompress(
    tensors: dict[str, torch.Tensor],
    args: WeightQuantArgs,
    fmt: str,
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """A module's (QuantizedWeight, g_idx or None) from its checkpoint tensors."""
    scale = tensors["weight_scale"]
    if fmt == "pack-quantized":
        shape = [int(v) for v in tensors["weight_shape"].tolist()]
        q = unpack_from_int32(tensors["weight_packed"], args.num_bits, shape[1], 1)
        zp = None
        if not args.symmetric:
            zp = unpack_from_int32(tensors["weight_zero_point"], args.num_bits, shape[0], 0)
    elif fmt == "naive-quantized":
        q = tensors["weight"].to(torch.int8)
        zp = tensors.get("weight_zero_point") if not args.symmetric else None
    else:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported")
    group = args.group_size_for(q.shape[1])
    return QuantizedWeight(q, scale, zp, group), tensors.get("weight_g_idx")

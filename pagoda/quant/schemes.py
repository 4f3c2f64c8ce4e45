"""Quantization schemes by name (compressed-tensors presets) and the config JSON they write.

W4A16 (int4 symmetric, group 128), W4A16_ASYM (int4 asymmetric, group 128) and W8A16 (int8
symmetric, group 128): the names and `config_groups` entries of compressed-tensors' presets,
with the group size configurable (-1 = one group per output channel). `quantization_config`
builds the exact dict llmcompressor writes into config.json.
"""

from __future__ import annotations

from typing import Any

from pagoda.quant.weights import WeightQuantArgs

SCHEMES: dict[str, WeightQuantArgs] = {
    "W4A16": WeightQuantArgs(num_bits=4, symmetric=True, group_size=128),
    "W4A16_ASYM": WeightQuantArgs(num_bits=4, symmetric=False, group_size=128),
    "W8A16": WeightQuantArgs(num_bits=8, symmetric=True, group_size=128),
}
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the format version pagoda writes (and was tested with)


def scheme_args(name: str, group_size: int = 128, actorder: str | None = None) -> WeightQuantArgs:
    """The `WeightQuantArgs` of a preset, with its group size and act-order set."""
    key = name.upper()
    if key not in SCHEMES:
        raise ValueError(f"scheme {name!r} is not supported; use one of {', '.join(SCHEMES)}")
    if group_size != -1 and (group_size < 1 or group_size % 8):
        raise ValueError(
            f"group_size must be -1 (per channel) or a positive multiple of 8, got {group_size}"
        )
    if actorder not in (None, "static"):
        raise ValueError(f"actorder={actorder!r} is not supported; use 'static' or none")
    base = SCHEMES[key]
    return WeightQuantArgs(base.num_bits, base.symmetric, group_size, actorder)


def weights_json(args: WeightQuantArgs) -> dict[str, Any]:
    """The `weights` entry of a config group, field for field as compressed-tensors dumps it."""
    per_channel = args.group_size == -1
    return {
        "actorder": args.actorder,
        "block_structure": None,
        "dynamic": False,
        "group_size": None if per_channel else args.group_size,
        "num_bits": args.num_bits,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "channel" if per_channel else "group",
        "symmetric": args.symmetric,
        "type": "int",
        "zp_dtype": None if args.symmetric else "torch.int8",
    }


def quantization_config(args: WeightQuantArgs, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for a pack-quantized checkpoint."""
    return {
        "config_groups": {
            "group_0": {
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights_json(args),
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }

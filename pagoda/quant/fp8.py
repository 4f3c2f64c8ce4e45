"""FP8 (e4m3) W8A8 checkpoints: compressed-tensors' `float-quantized` format and its schemes.

`Fp8Args` is what a config group of type "float", 8 bits says: weight scales per output channel
or per tensor, activations quantized per token at run time (dynamic) or with a calibrated
per-tensor `input_scale` (static). Per module the checkpoint holds `weight` float8_e4m3fn
[out, in], `weight_scale` [out, 1] (channel) or [1] (tensor), `input_scale` [1] when static.
`quantize_weight_fp8` is the rounding llmcompressor's min-max observer gives (scale = max|w| /
448, w / scale clamped and cast), used by `pagoda quantize` and by load-time quantization.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.quant.schemes import COMPRESSED_TENSORS_VERSION

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FLOAT_FORMAT = "float-quantized"
WEIGHT_STRATEGIES = ("channel", "tensor")
ACT_MODES = ("dynamic", "static", None)  # per-token dynamic, per-tensor static, weight-only


@dataclass(frozen=True)
class Fp8Args:
    """An FP8 config group: weight scale strategy and how activations are quantized."""

    weight_strategy: str = "channel"
    activations: str | None = "dynamic"

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(
                f"FP8 weight strategy {self.weight_strategy!r} is not supported; use "
                f"{' or '.join(WEIGHT_STRATEGIES)}"
            )
        if self.activations not in ACT_MODES:
            raise ValueError(f"FP8 activations={self.activations!r}: use dynamic, static or None")

    @property
    def static_input(self) -> bool:
        return self.activations == "static"

    # The fields QuantizationPlan users read from WeightQuantArgs (reports, factories).
    num_bits = 8

    @property
    def scheme_name(self) -> str:
        if self.activations == "dynamic":
            return "FP8_DYNAMIC"
        return "FP8" if self.activations == "static" else "FP8_WEIGHT_ONLY"


# The two presets of compressed-tensors (and llmcompressor) pagoda writes.
FP8_SCHEMES: dict[str, Fp8Args] = {
    "FP8_DYNAMIC": Fp8Args("channel", "dynamic"),
    "FP8": Fp8Args("tensor", "static"),
}


def parse_fp8_group(name: str, group: Mapping[str, Any]) -> Fp8Args:
    """`Fp8Args` of a compressed-tensors config group whose weights are 8-bit floats."""
    weights = group.get("weights") or {}
    if int(weights.get("num_bits", 8)) != 8:
        raise NotImplementedError(
            f"compressed-tensors group {name}: float weights of {weights.get('num_bits')} bits "
            "are not supported; pagoda serves FP8 (8-bit float) weights"
        )
    if not weights.get("symmetric", True):
        raise NotImplementedError(f"compressed-tensors group {name}: asymmetric FP8 weights")
    strategy = weights.get("strategy", "channel")
    if strategy not in WEIGHT_STRATEGIES:
        raise NotImplementedError(
            f"compressed-tensors group {name}: FP8 weight strategy {strategy!r} is not "
            "supported; use 'channel' (FP8_DYNAMIC) or 'tensor' (FP8)"
        )
    acts = group.get("input_activations")
    mode = None
    if acts:
        if acts.get("type", "float") != "float" or int(acts.get("num_bits", 8)) != 8:
            raise NotImplementedError(
                f"compressed-tensors group {name}: activations of type {acts.get('type')!r} / "
                f"{acts.get('num_bits')} bits with FP8 weights are not supported"
            )
        act_strategy = acts.get("strategy", "token")
        if acts.get("dynamic"):
            if act_strategy != "token":
                raise NotImplementedError(
                    f"compressed-tensors group {name}: dynamic activations by "
                    f"{act_strategy!r} are not supported; use 'token'"
                )
            mode = "dynamic"
        else:
            if act_strategy != "tensor":
                raise NotImplementedError(
                    f"compressed-tensors group {name}: static activation scales by "
                    f"{act_strategy!r} are not supported; use 'tensor'"
                )
            mode = "static"
    if group.get("output_activations"):
        raise NotImplementedError(
            f"compressed-tensors group {name}: output activation quantization is not supported"
        )
    return Fp8Args(strategy, mode)


def is_fp8_group(group: Mapping[str, Any]) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type") == "float"


def quantize_weight_fp8(
    w: torch.Tensor, strategy: str, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [out, in], scale [out, 1] or [1] in `scale_dtype`).

    The scale is rounded to `scale_dtype` first and the codes computed from the stored scale, so
    `codes * scale` is exactly what a reader dequantizes.
    """
    wf = w.float()
    if strategy == "channel":
        amax = wf.abs().amax(dim=1, keepdim=True)  # [out, 1]
    elif strategy == "tensor":
        amax = wf.abs().amax().reshape(1)
    else:
        raise ValueError(f"FP8 weight strategy {strategy!r}: use channel or tensor")
    scale = (amax / FP8_MAX).to(scale_dtype)
    tiny = torch.finfo(scale_dtype).tiny
    scale = torch.where(scale == 0, torch.full_like(scale, tiny), scale)
    q = (wf / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[out, in] weight in `dtype` from FP8 codes and their channel ([out, 1]) or tensor scale."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def static_input_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The per-tensor `input_scale` [1] (float32) of a calibrated max |x|."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    return torch.clamp(a / FP8_MAX, min=torch.finfo(torch.float32).tiny)


def param_shapes(args: Fp8Args, in_features: int, out_features_per_shard: list[int]):
    """(name, shape, dtype or None for the model dtype, output_dim) of a layer's tensors.

    A fused layer of per-tensor scales (q/k/v stored with one scale each) keeps one scale per
    shard ([shards]); `Fp8LinearMethod` folds them after loading.
    """
    out = sum(out_features_per_shard)
    shards = len(out_features_per_shard)
    specs = [("weight", (out, in_features), FP8_DTYPE, 0)]
    if args.weight_strategy == "channel":
        specs.append(("weight_scale", (out, 1), torch.float32, 0))
    else:
        specs.append(("weight_scale", (shards,), torch.float32, None))
    if args.static_input:
        specs.append(("input_scale", (shards,), torch.float32, None))
    return specs


def quantization_config(args: Fp8Args, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` of a float-quantized checkpoint, field for field as
    compressed-tensors 0.19 dumps llmcompressor's FP8_DYNAMIC / FP8 presets."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": args.weight_strategy,
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }
    acts = None
    if args.activations is not None:
        acts = {
            "actorder": None,
            "block_structure": None,
            "dynamic": args.activations == "dynamic",
            "group_size": None,
            "num_bits": 8,
            "observer": None if args.activations == "dynamic" else "static_minmax",
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": "token" if args.activations == "dynamic" else "tensor",
            "symmetric": True,
            "type": "float",
            "zp_dtype": None,
        }
    return {
        "config_groups": {
            "group_0": {
                "format": FLOAT_FORMAT,
                "input_activations": acts,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": FLOAT_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def kv_cache_scheme_json() -> dict[str, Any]:
    """`kv_cache_scheme` of an FP8 KV cache with static per-tensor K / V scales (as
    llmcompressor writes it; the scales are each attention layer's `k_scale` / `v_scale`)."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "tensor",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def fp8_supported_shape(n: int, k: int) -> bool:
    """cuBLASLt FP8 GEMMs need both dimensions to be multiples of 16."""
    return n % 16 == 0 and k % 16 == 0 and math.prod((n, k)) > 0

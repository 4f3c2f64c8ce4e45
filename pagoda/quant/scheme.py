"""The quantization scheme: how weights are quantized and which modules a checkpoint covers.

`QuantizationPlan` (per module: `WeightQuantArgs` and storage format, or unquantized) is read
from a checkpoint's `quantization_config` by `parse_quantization_config` (compressed-tensors,
legacy GPTQ, AutoAWQ). The weight descriptions themselves are in `weights.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.quant.formats.autoawq import parse_awq_config
from pagoda.quant.fp8 import FLOAT_FORMAT, Fp8Args, is_fp8_group, parse_fp8_group
from pagoda.quant.weights import WeightQuantArgs

CT_FORMATS = ("pack-quantized", "naive-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_FORMATS = ("awq-gemm",)
CHECKPOINT_FORMATS = CT_FORMATS + GPTQ_FORMATS + AWQ_FORMATS
# "fp8": an unquantized checkpoint quantized to FP8_DYNAMIC while it loads (vLLM's meaning);
# `fp8_at_load_config()` is the config that asks for it.
QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
FP8_AT_LOAD_FORMAT = "fp8-at-load"


def normalize_quant_method(name: str | None) -> str | None:
    """A user's `quantization=` ("AWQ", "gptq", ...) as the checkpoint spells it; None: auto."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"quantization must be a string or None, got {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key not in QUANT_METHODS:
        raise ValueError(
            f"quantization={name!r} is not supported; use one of {', '.join(QUANT_METHODS)} "
            "or None (read the checkpoint's quantization_config)"
        )
    return key


# ---------------------------------------------------------------- checkpoint config parsing


def _match(name: str, pattern: str) -> bool:
    """compressed-tensors / llmcompressor matching: `re:` at the start of the name, else exact."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _target_matches(name: str, target: str) -> bool:
    # Class targets ("Linear") select every linear layer; pagoda only asks about linear layers.
    if not target.startswith("re:") and target.endswith("Linear"):
        return True
    return _match(name, target)


@dataclass(frozen=True)
class QuantizationPlan:
    """Which modules a checkpoint quantizes, how, and in which storage format."""

    quant_method: str  # one of QUANT_METHODS
    # (targets, args, format); FP8 groups ("float-quantized", "fp8-at-load") carry `Fp8Args`
    groups: tuple[tuple[tuple[str, ...], WeightQuantArgs | Fp8Args, str], ...]
    ignore: tuple[str, ...]
    kv_cache_fp8: bool = False  # compressed-tensors `kv_cache_scheme`: FP8 K/V with scales

    def args_for(self, hf_name: str) -> tuple[WeightQuantArgs | Fp8Args, str] | None:
        """(args, format) of the HF module `hf_name`, or None when it stays unquantized.

        `lm_head` follows the same rules (quantized unless ignored, as in compressed-tensors);
        models ask about it only when their head is untied (see `lm_head_quantized`).
        """
        if any(_match(hf_name, pattern) for pattern in self.ignore):
            return None
        for targets, args, fmt in self.groups:
            if any(_target_matches(hf_name, t) for t in targets):
                return args, fmt
        return None


def _ct_weight_args(name: str, weights: Mapping[str, Any]) -> WeightQuantArgs:
    if weights.get("type", "int") != "int":
        raise NotImplementedError(
            f"compressed-tensors group {name}: weight type {weights.get('type')!r} is not "
            "supported; pagoda serves int weights (W4A16, W4A16_ASYM, W8A16)"
        )
    strategy = weights.get("strategy", "group")
    if strategy == "group":
        group_size = int(weights.get("group_size") or 128)
    elif strategy == "channel":
        group_size = -1
    else:
        raise NotImplementedError(
            f"compressed-tensors group {name}: weight strategy {strategy!r} is not supported; "
            "use 'group' or 'channel'"
        )
    return WeightQuantArgs(
        num_bits=int(weights.get("num_bits", 4)),
        symmetric=bool(weights.get("symmetric", True)),
        group_size=group_size,
        actorder=weights.get("actorder"),
    )


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> QuantizationPlan:
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", None):
        raise NotImplementedError(
            f"compressed-tensors quantization_status={status!r} is not supported; pagoda "
            "loads 'compressed' checkpoints"
        )
    top_format = qc.get("format") or "pack-quantized"
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or top_format
        if is_fp8_group(group) and fmt in (FLOAT_FORMAT, "naive-quantized"):
            # llmcompressor writes FP8 as float-quantized; naive-quantized stores it alike
            targets = tuple(group.get("targets") or ("Linear",))
            groups.append((targets, parse_fp8_group(name, group), FLOAT_FORMAT))
            continue
        if fmt not in CT_FORMATS:
            raise NotImplementedError(
                f"compressed-tensors format {fmt!r} (group {name}) is not supported; "
                f"supported: {', '.join(CT_FORMATS + (FLOAT_FORMAT,))}"
            )
        if group.get("input_activations") or group.get("output_activations"):
            raise NotImplementedError(
                f"compressed-tensors group {name} quantizes activations with int weights; "
                "pagoda supports weight-only int schemes (W4A16, W4A16_ASYM, W8A16) and FP8 "
                "(FP8_DYNAMIC, FP8)"
            )
        weights = group.get("weights")
        if not weights:
            continue
        targets = tuple(group.get("targets") or ("Linear",))
        groups.append((targets, _ct_weight_args(name, weights), fmt))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no weight config_groups")
    kv = _parse_kv_cache_scheme(qc.get("kv_cache_scheme"))
    return QuantizationPlan(
        "compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), kv_cache_fp8=kv
    )


def _parse_kv_cache_scheme(kv: Mapping[str, Any] | None) -> bool:
    """Whether `kv_cache_scheme` asks for an FP8 KV cache (per-tensor static k/v scales)."""
    if not kv:
        return False
    if kv.get("type", "float") != "float" or int(kv.get("num_bits", 8)) != 8:
        raise NotImplementedError(
            f"kv_cache_scheme of type {kv.get('type')!r} / {kv.get('num_bits')} bits is not "
            "supported; pagoda's quantized KV cache is FP8 (8-bit float)"
        )
    if kv.get("dynamic") or kv.get("strategy", "tensor") != "tensor":
        raise NotImplementedError(
            "kv_cache_scheme: only static per-tensor scales (k_scale / v_scale) are supported"
        )
    return True


def fp8_at_load_config() -> dict[str, Any]:
    """The `quantization_config` that quantizes a dense checkpoint to FP8_DYNAMIC at load
    (`LLM(..., quantization="fp8")`): every linear but lm_head and a vision tower."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignore": ["lm_head"]}


def _parse_fp8_at_load(qc: Mapping[str, Any]) -> QuantizationPlan:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(
            "quant_method 'fp8' quantizes at load with dynamic activation scales only; static "
            "scales need calibration (`pagoda quantize --scheme FP8`)"
        )
    ignore = tuple(qc.get("ignore") or ()) + ("re:.*visual.*",)
    args = Fp8Args("channel", "dynamic")
    return QuantizationPlan("fp8", ((("Linear",), args, FP8_AT_LOAD_FORMAT),), ignore)


def _parse_gptq(qc: Mapping[str, Any]) -> QuantizationPlan:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise NotImplementedError(f"GPTQ bits={bits} is not supported; use 4 or 8")
    fmt = qc.get("checkpoint_format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise NotImplementedError(f"GPTQ checkpoint_format={fmt!r} is not supported")
    args = WeightQuantArgs(
        num_bits=bits,
        symmetric=bool(qc.get("sym", True)),
        group_size=int(qc.get("group_size", 128)),
        actorder="group" if qc.get("desc_act") else None,
    )
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    if not qc.get("lm_head_quantized"):
        ignore += ("lm_head",)  # GPTQ quantizes the LM head only when it says so
    return QuantizationPlan("gptq", ((("Linear",), args, fmt),), ignore)


# AutoAWQ quantizes the linear layers inside the decoder blocks only (never lm_head, the
# embeddings or a vision tower), and skips a module when a `modules_to_not_convert` entry is
# a substring of its name.
_AWQ_TARGETS = (r"re:(.*\.)?layers\.\d+\.",)


def _parse_awq(qc: Mapping[str, Any]) -> QuantizationPlan:

    cfg = parse_awq_config(qc)
    args = WeightQuantArgs(num_bits=4, symmetric=not cfg.zero_point, group_size=cfg.group_size)
    ignore = tuple(f"re:.*{re.escape(m)}" for m in cfg.modules_to_not_convert) + ("lm_head",)
    return QuantizationPlan("awq", ((_AWQ_TARGETS, args, "awq-gemm"),), ignore)


def parse_quantization_config(qc: Mapping[str, Any]) -> QuantizationPlan:
    """Read a checkpoint's `quantization_config` (compressed-tensors, legacy GPTQ, AutoAWQ)."""
    method = qc.get("quant_method")
    method = method.lower() if isinstance(method, str) else method
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "gptq":
        return _parse_gptq(qc)
    if method == "awq":
        return _parse_awq(qc)
    if method == "fp8":
        return _parse_fp8_at_load(qc)
    raise NotImplementedError(
        f"quant_method={method!r} is not supported; pagoda loads compressed-tensors "
        "(pack-quantized, naive-quantized, float-quantized), gptq and awq (AutoAWQ GEMM) "
        "checkpoints"
    )

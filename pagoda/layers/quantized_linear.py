"""Weight-only quantized linear layers (W4A16 / W8A16) and the checkpoint config that picks them.

`WNA16LinearMethod` creates the parameters a checkpoint stores (compressed-tensors
`pack-quantized` / `naive-quantized`, or legacy GPTQ `qweight/qzeros/scales/g_idx`) so that the
fused loaders fill them by name, then `process_weights_after_loading` repacks them once for the
device: CUDA -> the split-K Triton GEMV for M <= 16 (decode), the Triton dequant-GEMM above,
and from `large_m_threshold(N, K)` on (pagoda/kernels/wna16.py) the weight dequantized into a
dense scratch matrix and multiplied by cuBLAS; CPU -> int8 codes dequantized per call (one
broadcast multiply) then a dense matmul.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.kernels.wna16 import (
    dequantize_weight,
    large_m_min,
    pack_factor,
    pack_to_int32,
    unpack_from_int32,
)
from pagoda.layers.linear import LinearMethod, LinearMethodFactory, UnquantizedLinearMethod

CT_FORMATS = ("pack-quantized", "naive-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")
_TINYGEMM_GROUPS = (32, 64, 128, 256)  # what torch's int4 GEMM accepts


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

    quant_method: str  # "compressed-tensors" | "gptq"
    groups: tuple[tuple[tuple[str, ...], WeightQuantArgs, str], ...]  # (targets, args, format)
    ignore: tuple[str, ...]

    def args_for(self, hf_name: str) -> tuple[WeightQuantArgs, str] | None:
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


def parse_quantization_config(qc: Mapping[str, Any]) -> QuantizationPlan:
    """Read a checkpoint's `quantization_config` (compressed-tensors or legacy GPTQ)."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
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
            if fmt not in CT_FORMATS:
                raise NotImplementedError(
                    f"compressed-tensors format {fmt!r} (group {name}) is not supported; "
                    f"supported: {', '.join(CT_FORMATS)}"
                )
            if group.get("input_activations") or group.get("output_activations"):
                raise NotImplementedError(
                    f"compressed-tensors group {name} quantizes activations; pagoda supports "
                    "weight-only schemes (W4A16, W4A16_ASYM, W8A16)"
                )
            weights = group.get("weights")
            if not weights:
                continue
            targets = tuple(group.get("targets") or ("Linear",))
            groups.append((targets, _ct_weight_args(name, weights), fmt))
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no weight config_groups")
        return QuantizationPlan("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()))
    if method == "gptq":
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
    raise NotImplementedError(
        f"quant_method={method!r} is not supported; pagoda loads compressed-tensors "
        "(pack-quantized, naive-quantized) and gptq checkpoints"
    )


def lm_head_quantized(factory: LinearMethodFactory) -> bool:
    """Whether `factory` quantizes `lm_head` (an untied model then builds a quantized head).

    Only factories made by `make_linear_method_factory` say so; any other factory (the
    default, tests' own) is never asked about lm_head, which then stays dense.
    """
    return bool(getattr(factory, "lm_head_quantized", False))


def make_linear_method_factory(
    qc: Mapping[str, Any], packed_modules_mapping: Mapping[str, list[str]]
) -> LinearMethodFactory:
    """The factory a model calls per linear layer: quantized where the checkpoint says so.

    A fused layer (qkv_proj) is quantized when its HF projections (q/k/v_proj) are, all alike.
    The factory's `lm_head_quantized` attribute tells whether the config covers lm_head.
    """
    plan = parse_quantization_config(qc)

    def factory(prefix: str) -> LinearMethod:
        parent, _, leaf = prefix.rpartition(".")
        hf_leaves = packed_modules_mapping.get(leaf, [leaf])
        names = [f"{parent}.{h}" if parent else h for h in hf_leaves]
        choices = [plan.args_for(n) for n in names]
        if any(c != choices[0] for c in choices):
            raise ValueError(
                f"{prefix}: the fused projections {', '.join(names)} are quantized differently "
                "in the checkpoint; pagoda needs them alike (quantize or ignore all of them)"
            )
        if choices[0] is None:
            return UnquantizedLinearMethod()
        args, fmt = choices[0]
        return WNA16LinearMethod(args, fmt)

    factory.lm_head_quantized = plan.args_for("lm_head") is not None  # type: ignore[attr-defined]
    return factory


# ---------------------------------------------------------------- the linear method


def _param(
    layer: nn.Module, name: str, data: torch.Tensor, output_dim: int | None, pack: int = 1
) -> None:
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = output_dim
    p.output_pack_factor = pack
    layer.register_parameter(name, p)


@dataclass
class _Unpacked:
    """A layer's weights in one canonical form, whatever the checkpoint format."""

    qweight: torch.Tensor  # [out, in] int8, signed values
    scale: torch.Tensor  # [out, groups] float
    zero_point: torch.Tensor | None  # [out, groups] int16 signed; None when symmetric
    g_idx: torch.Tensor | None  # [in] group of each input column; None when contiguous


def _use_mma_layout(
    bits: int, symmetric: bool, dtype: torch.dtype, n: int, k: int, group: int, device
) -> bool:
    """Whether a CUDA layer gets the tensor-core layout (`triton_w4a16_mma`): 4-bit symmetric
    bf16 weights with N % 16 == 0, K % 64 == 0 and groups of a multiple of 64 (or one per
    column), on sm_80+ (`mma.sync` bf16) where `mma_self_test` passed (once per device).
    `PAGODA_W4A16_MMA=0` keeps the older layout."""
    from pagoda.kernels.triton_w4a16_mma import mma_supported

    if os.environ.get("PAGODA_W4A16_MMA", "1").lower() in ("0", "false", "off", "no"):
        return False
    if not (symmetric and dtype == torch.bfloat16 and mma_supported(n, k, group, bits, False)):
        return False
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    from pagoda.kernels.triton_w4a16_mma import mma_self_test

    return mma_self_test(device.index if device.index is not None else torch.cuda.current_device())


def _env_rows(name: str) -> int | None:
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        return max(0, min(64, int(env)))
    except ValueError:
        raise ValueError(f"{name}={env!r}: use an integer 0..64") from None


def _env_flag(name: str, default: bool = False) -> bool:
    """An on/off switch: 1/true/on/yes or 0/false/off/no (unset or empty: `default`)."""
    env = os.environ.get(name, "").strip().lower()
    if not env:
        return default
    if env in ("1", "true", "on", "yes"):
        return True
    if env in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={env!r}: use 1 / on or 0 / off")


def _mma_max_m(n: int, k: int, device: torch.device | None = None) -> int:
    """Largest M that runs the tensor-core GEMV on an [n, k] layer (then `_mma_gemm_max_m`,
    then dequant + cuBLAS).

    Up to 32 rows the blocks of 8 share one dequantization per word (`shared`). Measured on the
    H200 (session 6 runs 2 and 4, Qwen2.5-7B shapes, µs): at M = 32 the GEMV beats dequant +
    cuBLAS on every layer (qkv 16.1 vs 20.2, o 13.6 vs 18.5, gate_up 67.0 vs 170.9, down 42.9 vs
    89.2); at M = 64 it loses to the MMA-layout GEMM on gate_up / down (145.8 vs 118.6, 91.0 vs
    74.3) and to dequant + cuBLAS on qkv / o (32.2 vs 20.7, 29.5 vs 17.3). Where the shared
    kernel is off (`PAGODA_W4A16_MMA_SHARED=0` or its self-test failed) every block
    re-dequantizes: 16 rows, 32 on layers of >= 64 Mi weights (session 5, run 10).
    `PAGODA_W4A16_MMA_MAX_M` (0..64) overrides."""
    env = _env_rows("PAGODA_W4A16_MMA_MAX_M")
    if env is not None:
        return env
    if not _shared_on(device):
        return _MMA_MAX_M_LARGE_OLD if n * k >= _MMA_LARGE_LAYER else _MMA_MAX_M_OLD
    return _MMA_MAX_M


def _mma_gemm_max_m(n: int, k: int) -> int:
    """Largest M that runs `wna16_mma_gemm` (past the GEMV's rows): 64 on layers of >= 64 Mi
    weights, where it beat both the GEMV and dequant + cuBLAS at M = 64 (above); none on the
    smaller ones, and above 64 rows the dequant pass + cuBLAS wins everywhere (M = 128: gate_up
    170.8 vs 218.9, down 93.8 vs 126.9). `PAGODA_W4A16_MMA_GEMM_MAX_M` (0..64) overrides."""
    env = _env_rows("PAGODA_W4A16_MMA_GEMM_MAX_M")
    if env is not None:
        return env
    return _MMA_GEMM_MAX_M if n * k >= _MMA_LARGE_LAYER else 0


def _shared_on(device: torch.device | None) -> bool:
    """Whether the shared-dequantization GEMV runs on `device` (None: the CPU interpreter)."""
    from pagoda.kernels.triton_w4a16_mma import _shared_enabled

    return _shared_enabled(device if device is not None else torch.device("cpu"))


_MMA_MAX_M = 32
_MMA_GEMM_MAX_M = 64
_MMA_MAX_M_OLD = 16  # one dequantization per block of 8 rows (the session-5 kernel)
_MMA_MAX_M_LARGE_OLD = 32
_MMA_LARGE_LAYER = 64 << 20  # weights: Qwen2.5-7B gate_up (136 Mi) and down (68 Mi)


class WNA16LinearMethod(LinearMethod):
    """Weight-only int4/int8 linear layer (compressed-tensors or legacy GPTQ checkpoints).

    After loading, a CUDA layer with 4-bit symmetric bf16 weights of a supported shape holds
    the tensor-core layout `mma_words` / `mma_scales` (`kernels/triton_w4a16_mma.py`; see
    `_use_mma_layout`); other CUDA layers hold `qweight_t` [in / f, out] int32 (packed along the
    input, f = 32 / bits), `scales_t` [groups, out] and optional `zeros_t` [groups, out]
    (2^(bits-1) + zero point, as float); elsewhere `codes` [out, in] int8, `scales` and `zeros`
    [out, groups]. Act-order checkpoints with a g_idx also get `input_perm` [in]: the weight's
    columns are sorted by group so that groups are contiguous; x is permuted alike per call.
    A fused layer keeps one g_idx: its projections read one input, so GPTQ's act-order (by
    that input's Hessian) gives them the same one, as vLLM also assumes.
    """

    def __init__(self, args: WeightQuantArgs, checkpoint_format: str = "pack-quantized") -> None:
        if checkpoint_format not in CT_FORMATS + GPTQ_FORMATS:
            raise ValueError(f"unknown quantized checkpoint format {checkpoint_format!r}")
        self.args = args
        self.format = checkpoint_format
        self._ckpt_params: tuple[str, ...] = ()

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features_per_shard: list[int],
        dtype: torch.dtype,
    ) -> None:
        args, f = self.args, pack_factor(self.args.num_bits)
        out = sum(out_features_per_shard)
        group = args.group_size_for(in_features)
        num_groups = math.ceil(in_features / group)
        layer.wna16_group_size = group
        asym_packed = not args.symmetric and self.format in ("pack-quantized",) + GPTQ_FORMATS
        if asym_packed and any(o % f for o in out_features_per_shard):
            raise ValueError(
                f"{getattr(layer, 'prefix', '')}: output sizes {out_features_per_shard} are not "
                f"multiples of {f}, so packed zero points cannot be split by shard"
            )
        if self.format == "pack-quantized":
            _param(
                layer,
                "weight_packed",
                torch.zeros(out, math.ceil(in_features / f), dtype=torch.int32),
                0,
            )
            _param(layer, "weight_scale", torch.ones(out, num_groups, dtype=dtype), 0)
            # [out, in] of the checkpoint; one shape per HF module, so not split by shard.
            _param(layer, "weight_shape", torch.zeros(2, dtype=torch.int64), None)
            names = ["weight_packed", "weight_scale", "weight_shape"]
            if not args.symmetric:
                _param(
                    layer,
                    "weight_zero_point",
                    torch.zeros(out // f, num_groups, dtype=torch.int32),
                    0,
                    f,
                )
                names.append("weight_zero_point")
        elif self.format == "naive-quantized":
            _param(layer, "weight", torch.zeros(out, in_features, dtype=torch.int8), 0)
            _param(layer, "weight_scale", torch.ones(out, num_groups, dtype=dtype), 0)
            names = ["weight", "weight_scale"]
            if not args.symmetric:
                _param(
                    layer, "weight_zero_point", torch.zeros(out, num_groups, dtype=torch.int8), 0
                )
                names.append("weight_zero_point")
        else:  # legacy GPTQ: [in, out] layouts, output along dim 1
            _param(
                layer, "qweight", torch.zeros(math.ceil(in_features / f), out, dtype=torch.int32), 1
            )
            _param(layer, "qzeros", torch.zeros(num_groups, out // f, dtype=torch.int32), 1, f)
            _param(layer, "scales", torch.ones(num_groups, out, dtype=dtype), 1)
            _param(layer, "g_idx", torch.zeros(in_features, dtype=torch.int32), None)
            names = ["qweight", "qzeros", "scales", "g_idx"]
        if self.format in CT_FORMATS and args.has_g_idx:
            _param(layer, "weight_g_idx", torch.zeros(in_features, dtype=torch.int32), None)
            names.append("weight_g_idx")
        self._ckpt_params = tuple(names)

    # ------------------------------------------------------------ after loading

    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random codes and small scales for dummy-weight benchmarks (the loader's "dummy")."""
        for name in self._ckpt_params:
            p = getattr(layer, name).data
            if name in ("weight_packed", "qweight", "weight_zero_point", "qzeros"):
                p.copy_(
                    torch.randint(
                        -(2**31),
                        2**31 - 1,
                        p.shape,
                        generator=generator,
                        device=p.device,
                        dtype=torch.int64,
                    ).to(torch.int32)
                )
            elif name in ("weight_scale", "scales"):
                # |q| <= 8: these scales give weights of the dense dummy's size (0.05).
                p.uniform_(0.002, 0.008, generator=generator)
            elif name == "weight":
                p.copy_(torch.randint(-8, 8, p.shape, generator=generator, device=p.device))
            elif name == "weight_shape":
                p.copy_(torch.tensor([getattr(layer, "out_features", 0), 0]))
            elif name == "g_idx":
                p.copy_(torch.arange(p.numel(), device=p.device) // layer.wna16_group_size)

    def _unpack(self, layer: nn.Module) -> _Unpacked:
        args = self.args
        in_features, out = layer.in_features, layer.out_features
        zp = g_idx = None
        if self.format == "pack-quantized":
            q = unpack_from_int32(layer.weight_packed.data, args.num_bits, in_features, 1)
            scale = layer.weight_scale.data
            if not args.symmetric:
                zp = unpack_from_int32(layer.weight_zero_point.data, args.num_bits, out, 0)
        elif self.format == "naive-quantized":
            q, scale = layer.weight.data.to(torch.int8), layer.weight_scale.data
            if not args.symmetric:
                zp = layer.weight_zero_point.data
        else:
            # Unsigned codes u in [0, 2^b): unpacking subtracts 2^(b-1), so q = u - 2^(b-1).
            q = unpack_from_int32(layer.qweight.data, args.num_bits, in_features, 0).t()
            scale = layer.scales.data.t()
            z = unpack_from_int32(layer.qzeros.data, args.num_bits, out, 1).t().to(torch.int16)
            # GPTQ v1 stores zero - 1 (the AutoGPTQ off-by-one); v2 stores the zero itself.
            zp = z + 1 if self.format == "gptq" else z
            g_idx = layer.g_idx.data
            if not bool(zp.any()):
                zp = None  # symmetric: every zero point is the midpoint
        if self.format in CT_FORMATS and args.has_g_idx:
            g_idx = layer.weight_g_idx.data
        if zp is not None:
            zp = zp.to(torch.int16)
        if g_idx is not None:
            group = layer.wna16_group_size
            trivial = torch.arange(in_features, device=g_idx.device) // group
            if torch.equal(g_idx.long(), trivial):
                g_idx = None
        if q.shape != (out, in_features):
            raise ValueError(f"{layer.prefix}: unpacked weight has shape {tuple(q.shape)}")
        return _Unpacked(q.contiguous(), scale, zp, g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        u = self._unpack(layer)
        args, group = self.args, layer.wna16_group_size
        in_features = layer.in_features
        dtype, device = layer.params_dtype, u.qweight.device
        for name in self._ckpt_params:
            delattr(layer, name)
        qweight, scale, zp = u.qweight, u.scale, u.zero_point
        perm = None
        if u.g_idx is not None:
            # Sort columns by group so every group is contiguous (as vLLM does for act-order).
            perm = torch.argsort(u.g_idx.long(), stable=True)
            sorted_groups = u.g_idx.long()[perm]
            expected = torch.arange(in_features, device=device) // group
            if not torch.equal(sorted_groups, expected):
                raise ValueError(f"{layer.prefix}: g_idx does not give every group {group} columns")
            qweight = qweight[:, perm].contiguous()
            _param(layer, "input_perm", perm.to(torch.int64), None)
        else:
            layer.input_perm = None
        layer.wna16_bits = args.num_bits
        if device.type != "cuda" or (group < in_features and group % 16):
            # Dequantize per call from int8 codes (1 byte per weight). torch's CPU int4 GEMM
            # (_weight_int4pack_mm_for_cpu) measured 56x (M=1) to 80x (M=512) slower than the
            # dense fp32 matmul on the 2-core CI machine; int8 codes dequantize in ~0.3 ms per
            # million weights, a small cost next to the matmul, and memory stays <= 1 B/weight.
            layer.wna16_backend = "dequant"
            _param(layer, "codes", qweight.contiguous(), None)  # [out, in] int8
            _param(layer, "scales", scale.to(dtype).contiguous(), None)  # [out, groups]
            if zp is not None:
                _param(layer, "zeros", zp.to(dtype).contiguous(), None)  # [out, groups]
            else:
                layer.zeros = None
            return
        scale_t = scale.t().to(dtype).contiguous()  # [groups, out]
        if _use_mma_layout(
            args.num_bits, zp is None, dtype, layer.out_features, in_features, group, device
        ):
            # 4-bit symmetric bf16 on sm_80+: the tensor-core GEMV's layout, the only copy
            # (M <= 64: `wna16_mma_gemv`; larger M: `wna16_mma_dequant` + cuBLAS).
            from pagoda.kernels.triton_w4a16_mma import repack_mma, repack_mma_scales

            layer.wna16_backend = "mma"
            _param(layer, "mma_words", repack_mma(qweight.to(torch.int32) + 8), None)
            _param(layer, "mma_scales", repack_mma_scales(scale_t), None)
            return
        layer.wna16_backend = "triton"  # tl.dot needs K-tiles of >= 16 inside one group
        offset = 1 << (args.num_bits - 1)
        _param(layer, "qweight_t", pack_to_int32(qweight, args.num_bits, 1).t().contiguous(), None)
        _param(layer, "scales_t", scale_t, None)
        if zp is not None:
            # The kernel reads unsigned codes u = q + offset: w = (u - (offset + zp)) * s.
            zeros_t = (zp.t().to(torch.float32) + offset).to(dtype).contiguous()
            _param(layer, "zeros_t", zeros_t, None)
        else:
            layer.zeros_t = None
        if (
            os.environ.get("PAGODA_WNA16_SMALL_M") == "tinygemm"
            and args.num_bits == 4
            and dtype == torch.bfloat16
            and group in _TINYGEMM_GROUPS
            and layer.out_features % 8 == 0
            and in_features % 1024 == 0
        ):
            # Opt-in second copy in torch's tinygemm layout for M <= 16 (the H200 GEMM
            # benchmark decides whether it beats the split-K Triton path).
            codes = qweight.to(torch.int32) + 8
            packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
            zero = torch.zeros_like(scale_t) if zp is None else -(zp.t().to(dtype) * scale_t)
            _param(layer, "int4pack", torch._convert_weight_to_int4pack(packed_u8, 8), None)
            sz = torch.stack([scale_t, zero], dim=-1).contiguous()
            _param(layer, "scale_and_zeros", sz, None)

    # ------------------------------------------------------------ forward

    def _dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] weight in the kernel's column order (act-order: sorted by group)."""
        if layer.wna16_backend == "dequant":
            q, scale, zp = layer.codes, layer.scales, layer.zeros
        elif layer.wna16_backend == "mma":
            from pagoda.kernels.triton_w4a16_mma import unpack_mma, unpack_mma_scales

            n, k = layer.out_features, layer.in_features
            q = (unpack_mma(layer.mma_words.data, n, k).to(torch.int16) - 8).to(torch.int8)
            scale, zp = unpack_mma_scales(layer.mma_scales.data).t(), None
        else:
            # [in / f, out] packed along the input -> [out, in] signed codes
            q = unpack_from_int32(layer.qweight_t.data, layer.wna16_bits, layer.in_features, 0).t()
            scale = layer.scales_t.t()
            zp = None
            if layer.zeros_t is not None:
                zp = layer.zeros_t.t().to(torch.float32) - (1 << (layer.wna16_bits - 1))
        out_features, in_features = q.shape
        group = layer.wna16_group_size
        if in_features % group == 0:
            # [out, groups, group] * [out, groups, 1]: one broadcast, no expanded scale copy.
            w = q.view(out_features, -1, group).to(torch.float32)
            if zp is not None:
                w = w - zp.to(torch.float32).unsqueeze(-1)
            w = (w * scale.to(torch.float32).unsqueeze(-1)).view(out_features, in_features)
            return w.to(dtype)
        return dequantize_weight(q, scale, zp, group, dtype=dtype)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] weight in the layer dtype, in the checkpoint's column order."""
        w = self._dequantize(layer, layer.params_dtype)
        if layer.input_perm is not None:
            w = w[:, torch.argsort(layer.input_perm)]
        return w.contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, in]
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)
        if layer.wna16_backend == "mma":
            out, bias_added = self._apply_mma(layer, x2, bias)
            if bias is not None and not bias_added:
                out = out + bias
        elif layer.wna16_backend == "triton":
            out, bias_added = self._apply_cuda(layer, x2, bias)
            if bias is not None and not bias_added:
                out = out + bias
        else:
            out = torch.nn.functional.linear(x2, self._dequantize(layer, x.dtype), bias)
        return out.reshape(*shape[:-1], out.shape[-1])

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(x W_gate^T) * (x W_up^T) for a [gate; up] layer in one kernel, where the
        tensor-core GEMV can fuse it (M <= 8, bf16: decode) and `PAGODA_W4A16_FUSED_SILU=1`
        asks for it; None otherwise (the caller runs the projection, then the activation).

        Opt-in because it measured no faster (H200, session 7 run 3, Qwen2.5-7B batch 1):
        459.4 / 459.2 tok/s with it, 461.3 / 460.5 without; alone, gate_up + activation 28.2 µs
        vs the gated GEMV's 27.6, a program walking two column groups streams no faster."""
        from pagoda.kernels.triton_w4a16_mma import MAX_M, wna16_mma_gemv

        if not _env_flag("PAGODA_W4A16_FUSED_SILU"):
            return None  # the default
        n = layer.out_features
        x2 = x.reshape(-1, x.shape[-1])
        if (
            layer.wna16_backend != "mma"
            or x.dtype != torch.bfloat16
            or not 1 <= x2.shape[0] <= MAX_M
            or n % 32
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
        ):
            return None
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)
        out = wna16_mma_gemv(
            x2, layer.mma_words, layer.mma_scales, n, layer.wna16_group_size, bias=bias, gated=True
        )
        return out.reshape(*x.shape[:-1], n // 2)

    # M <= 16 on CUDA (decode): "gemv" (the split-K Triton GEMV, default), "tinygemm" (torch's
    # _weight_int4pack_mm on a second, int4-packed copy of 4-bit bf16 weights, made on the first
    # call; other layers use the GEMV) or "gemm" (the Triton dequant-GEMM). Read once at import
    # so that benchmarks can A/B them; the older PAGODA_WNA16_SMALL_M=tinygemm still works.
    small_m_kernel: str = os.environ.get("PAGODA_W4A16_SMALL_M") or (
        "tinygemm" if os.environ.get("PAGODA_WNA16_SMALL_M") == "tinygemm" else "gemv"
    )
    if small_m_kernel not in ("gemv", "tinygemm", "gemm"):
        raise ValueError(
            f"PAGODA_W4A16_SMALL_M={small_m_kernel!r}: use 'gemv', 'tinygemm' or 'gemm'"
        )

    def _tinygemm_ready(self, layer: nn.Module) -> bool:
        """Whether `layer` has (or now gets) torch's int4 layout; never built during capture."""
        if hasattr(layer, "int4pack"):
            return True
        scale_t = layer.scales_t
        if (
            layer.wna16_bits != 4
            or scale_t.dtype != torch.bfloat16
            or layer.wna16_group_size not in _TINYGEMM_GROUPS
            or layer.out_features % 8
            or layer.in_features % 1024
            or torch.cuda.is_current_stream_capturing()
        ):
            return False
        q = unpack_from_int32(layer.qweight_t.data, 4, layer.in_features, 0).t()  # [out, in]
        codes = q.to(torch.int32) + 8
        packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
        zero = torch.zeros_like(scale_t)
        if layer.zeros_t is not None:  # w = (q - zp) * s = q * s + zero
            zero = -((layer.zeros_t.to(torch.float32) - 8) * scale_t.float()).to(scale_t.dtype)
        _param(layer, "int4pack", torch._convert_weight_to_int4pack(packed_u8, 8), None)
        _param(layer, "scale_and_zeros", torch.stack([scale_t, zero], dim=-1).contiguous(), None)
        return True

    def _large_m(self, layer: nn.Module) -> int | None:
        """The M from which `layer` runs dequant + cuBLAS (None: never): `large_m_threshold`
        or `PAGODA_W4A16_LARGE_M=<int>` (0 = never), resolved on the layer's first call with
        M > 16 (the profiling forward, before CUDA-graph capture) and kept on the layer."""
        large_m = getattr(layer, "wna16_large_m", -1)
        if large_m == -1:
            from pagoda.kernels.triton_w4a16 import _device_name, _num_sms, _tuned_gemm_table

            w = layer.qweight_t
            n, k, bits = w.shape[1], layer.in_features, layer.wna16_bits
            num_sms = _num_sms(w.device.index or 0) if w.is_cuda else 132
            tuned = w.is_cuda and (n, k, layer.wna16_group_size, bits) in _tuned_gemm_table(
                _device_name(w.device.index or 0)
            )
            large_m = large_m_min(n, k, bits, num_sms, gemm_tuned=tuned)
            layer.wna16_large_m = large_m
        return large_m

    def _apply_mma(
        self, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool]:
        """(x2 @ W^T, whether `bias` is already added) for the tensor-core layout."""
        from pagoda.kernels.triton_w4a16_mma import (
            wna16_mma_dequant,
            wna16_mma_gemm,
            wna16_mma_gemv,
        )

        n, k, group = layer.out_features, layer.in_features, layer.wna16_group_size
        m = x2.shape[0]
        fused = bias is not None and bias.dtype == x2.dtype and bias.is_contiguous()
        if x2.dtype == torch.bfloat16 and m <= _mma_max_m(n, k, x2.device):
            out = wna16_mma_gemv(
                x2, layer.mma_words, layer.mma_scales, n, group, bias=bias if fused else None
            )
            return out, fused
        if x2.dtype == torch.bfloat16 and m <= _mma_gemm_max_m(n, k):
            out = wna16_mma_gemm(
                x2, layer.mma_words, layer.mma_scales, n, group, bias=bias if fused else None
            )
            return out, fused
        # cuBLAS adds the bias in its epilogue (a separate add measured 7.4 µs per layer of a
        # 512-token Qwen2.5-7B prefill on the H200: session 7, benchmarks/profile_prefill.py)
        w = wna16_mma_dequant(layer.mma_words, layer.mma_scales, n, k, group)
        return torch.nn.functional.linear(x2, w.to(x2.dtype), bias if fused else None), fused

    def _apply_cuda(
        self, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool]:
        """(x2 @ W^T, whether `bias` is already added: the GEMV fuses it)."""
        from pagoda.kernels.triton_w4a16 import wna16_dequant_linear, wna16_gemm, wna16_gemv

        # (qweight_t, scales_t, zeros_t, group_size, bits): what every kernel below takes
        weights = (
            layer.qweight_t,
            layer.scales_t,
            layer.zeros_t,
            layer.wna16_group_size,
            layer.wna16_bits,
        )

        if x2.shape[0] <= 16:
            kernel = self.small_m_kernel
            if kernel == "tinygemm" and self._tinygemm_ready(layer):
                sz = layer.scale_and_zeros
                out = torch._weight_int4pack_mm(
                    x2.to(sz.dtype).contiguous(), layer.int4pack, layer.wna16_group_size, sz
                )
                return out.to(x2.dtype), False
            if kernel != "gemm":
                fused = bias is not None and bias.dtype == x2.dtype and bias.is_contiguous()
                return wna16_gemv(x2, *weights, bias=bias if fused else None), fused
        else:
            # Large M: one bandwidth-bound pass into a scratch weight (from the caching
            # allocator, so profiled and capturable), then cuBLAS.
            large_m = self._large_m(layer)
            if large_m is not None and x2.shape[0] >= large_m:
                return wna16_dequant_linear(x2, *weights), False
        return wna16_gemm(x2, *weights), False

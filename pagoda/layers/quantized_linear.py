"""Weight-only quantized linear layers (W4A16 / W8A16) and the checkpoint config that picks them.

`WNA16LinearMethod` registers the tensors its checkpoint format stores (`pagoda.quant.formats`:
compressed-tensors, legacy GPTQ, AutoAWQ GEMM) so the fused loaders fill them by name; after
loading it unpacks them to the canonical codes / scales / zero points, picks the layer's kernels
from the registry (`layers/wna16_kernels.py`, once per layer) and lets them repack the weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pagoda.layers.fp8_linear import Fp8LinearMethod
from pagoda.layers.linear import LinearMethod, LinearMethodFactory, UnquantizedLinearMethod
from pagoda.layers.wna16_kernels import choose_kernels, dense_weight, kernel_config
from pagoda.quant.formats import format_module
from pagoda.quant.fp8 import FLOAT_FORMAT
from pagoda.quant.scheme import (
    CHECKPOINT_FORMATS,
    FP8_AT_LOAD_FORMAT,
    parse_quantization_config,
)
from pagoda.quant.weights import UnpackedWeight, WeightQuantArgs


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
        if fmt == FLOAT_FORMAT:
            return Fp8LinearMethod(args)
        if fmt == FP8_AT_LOAD_FORMAT:
            return Fp8LinearMethod(args, quantize_at_load=True)
        return WNA16LinearMethod(args, fmt)

    factory.lm_head_quantized = plan.args_for("lm_head") is not None  # type: ignore[attr-defined]
    return factory


# ---------------------------------------------------------------- the linear method


class WNA16LinearMethod(LinearMethod):
    """Weight-only int4/int8 linear layer of any supported checkpoint format.

    After loading the layer holds its kernels' layout (`layer.wna16_kernels`, a `KernelTable`;
    `layer.wna16_backend` names the layout: "mma", "triton" or "dequant"). Act-order
    checkpoints with a g_idx also get `input_perm` [in]: the weight's columns are sorted by
    group so that groups are contiguous; x is permuted alike per call. A fused layer keeps one
    g_idx: its projections read one input, so GPTQ's act-order (by that input's Hessian) gives
    them the same one, as vLLM also assumes.
    """

    def __init__(self, args: WeightQuantArgs, checkpoint_format: str = "pack-quantized") -> None:
        if checkpoint_format not in CHECKPOINT_FORMATS:
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
        layer.wna16_group_size = self.args.group_size_for(in_features)
        try:
            specs = format_module(self.format).param_specs(
                self.format, self.args, in_features, out_features_per_shard
            )
        except ValueError as e:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: {e}") from None
        for spec in specs:
            data = torch.zeros(spec.shape, dtype=spec.dtype or dtype)
            p = nn.Parameter(data, requires_grad=False)
            p.output_dim = spec.output_dim
            p.output_pack_factor = spec.output_pack
            layer.register_parameter(spec.name, p)
        self._ckpt_params = tuple(spec.name for spec in specs)

    # ------------------------------------------------------------ after loading

    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random codes and small scales for dummy-weight benchmarks (the loader's "dummy")."""
        for name in self._ckpt_params:
            p = getattr(layer, name).data
            if name == "weight_shape":
                p.copy_(torch.tensor([getattr(layer, "out_features", 0), 0]))
            elif name == "g_idx":
                p.copy_(torch.arange(p.numel(), device=p.device) // layer.wna16_group_size)
            elif p.dtype == torch.int32:  # packed codes and zero points
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
            elif p.is_floating_point():
                # |q| <= 8: these scales give weights of the dense dummy's size (0.05).
                p.uniform_(0.002, 0.008, generator=generator)
            elif name == "weight":
                p.copy_(torch.randint(-8, 8, p.shape, generator=generator, device=p.device))

    def _unpack(self, layer: nn.Module) -> UnpackedWeight:
        tensors = {name: getattr(layer, name).data for name in self._ckpt_params}
        u = format_module(self.format).unpack_params(
            self.format, tensors, self.args, layer.in_features, layer.out_features
        )
        g_idx = u.g_idx
        if g_idx is not None:
            trivial = torch.arange(layer.in_features, device=g_idx.device)
            if torch.equal(g_idx.long(), trivial // layer.wna16_group_size):
                g_idx = None
        if u.codes.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"{layer.prefix}: unpacked weight has shape {tuple(u.codes.shape)}")
        zp = None if u.zero_point is None else u.zero_point.to(torch.int16)
        return UnpackedWeight(u.codes.contiguous(), u.scale, zp, g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        u = self._unpack(layer)
        group, in_features = layer.wna16_group_size, layer.in_features
        device = u.codes.device
        for name in self._ckpt_params:
            delattr(layer, name)
        if u.g_idx is not None:
            # Sort columns by group so every group is contiguous (as vLLM does for act-order).
            perm = torch.argsort(u.g_idx.long(), stable=True)
            expected = torch.arange(in_features, device=device) // group
            if not torch.equal(u.g_idx.long()[perm], expected):
                raise ValueError(f"{layer.prefix}: g_idx does not give every group {group} columns")
            u = UnpackedWeight(u.codes[:, perm].contiguous(), u.scale, u.zero_point, None)
            p = nn.Parameter(perm.to(torch.int64), requires_grad=False)
            p.output_dim = None
            layer.register_parameter("input_perm", p)
        else:
            layer.input_perm = None
        layer.wna16_bits = self.args.num_bits
        cfg = kernel_config(layer, self.args.num_bits, u.zero_point is not None, device)
        table = choose_kernels(cfg)
        layer.wna16_kernels = table
        layer.wna16_backend = table.layout
        table.entries[0][1].prepare(layer, u)

    # ------------------------------------------------------------ forward

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] weight in the layer dtype, in the checkpoint's column order."""
        w = dense_weight(layer, layer.params_dtype)
        if layer.input_perm is not None:
            w = w[:, torch.argsort(layer.input_perm)]
        return w.contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, in]
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)
        out, bias_added = layer.wna16_kernels.pick(x2.shape[0]).apply(layer, x2, bias)
        if bias is not None and not bias_added:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

"""FP8 schemes in the quantization pipeline: min-max e4m3 weights and calibrated scales.

FP8_DYNAMIC (per-channel weight scales; activations quantized per token at run time, so no
calibration) and FP8 (per-tensor weight scales, one static `input_scale` per linear from the
largest |x| seen on the calibration data), as llmcompressor's `QuantizationModifier` makes them:
scale = max|w| / 448, codes rounded to nearest. `KVScaleObserver` records each attention layer's
largest |k| and |v| (after RoPE: what the cache stores) for `k_scale` / `v_scale`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.quant.fp8 import Fp8Args, dequantize_weight_fp8, quantize_weight_fp8, static_input_scale


def quantize_fp8_shards(
    w: torch.Tensor, sizes: list[int], args: Fp8Args, scale_dtype: torch.dtype
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """([(codes, scale)] per shard, dequantized [out, in] float32) of a fused [out, in] matrix.

    Per-tensor scales are per HF module (each shard its own), as the checkpoint stores them.
    """
    parts, deq, row = [], [], 0
    for size in sizes:
        q, s = quantize_weight_fp8(w[row : row + size], args.weight_strategy, scale_dtype)
        parts.append((q, s))
        deq.append(dequantize_weight_fp8(q, s, torch.float32))
        row += size
    return parts, torch.cat(deq)


def fp8_tensors(
    q: torch.Tensor, scale: torch.Tensor, input_amax: torch.Tensor | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A module's float-quantized tensors (names relative to the module)."""
    tensors = {"weight": q.contiguous(), "weight_scale": scale.to(dtype).contiguous()}
    if input_amax is not None:
        tensors["input_scale"] = static_input_scale(input_amax).to(dtype)
    return tensors


class AmaxObserver:
    """max |input| of the modules it hooks (forward pre-hooks), by key."""

    def __init__(self) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def watch(self, module: nn.Module, key: str) -> None:
        def hook(_m: nn.Module, inputs: tuple) -> None:
            a = inputs[0].detach().abs().amax().float()
            self.amax[key] = torch.maximum(self.amax[key], a) if key in self.amax else a

        self._handles.append(module.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class KVScaleObserver:
    """max |k| and |v| an attention module (`Attention`) receives: forward pre-hook on its
    (q, k, v, metadata) arguments; k has RoPE applied, as the cache stores it."""

    def __init__(self) -> None:
        self.k_amax: dict[str, torch.Tensor] = {}
        self.v_amax: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def watch(self, attn: nn.Module, key: str) -> None:
        def hook(_m: nn.Module, args: tuple) -> None:
            for store, t in ((self.k_amax, args[1]), (self.v_amax, args[2])):
                a = t.detach().abs().amax().float()
                store[key] = torch.maximum(store[key], a) if key in store else a

        self._handles.append(attn.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def scales(self, key: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`k_scale` / `v_scale` [1] of one layer: max |x| / 448 (e4m3's largest value)."""
        return {
            "k_scale": static_input_scale(self.k_amax[key]).to(dtype),
            "v_scale": static_input_scale(self.v_amax[key]).to(dtype),
        }

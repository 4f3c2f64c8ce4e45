"""AWQ's per-layer guard: of the rounded layers it can write, the one nearest the float layer.

AWQ's scale and clip searches each minimise a local proxy (one module rounded alone, one group's
share of one output); together they can still leave the layer further from float than plain
rounding. The guard scores whole candidates (smoothed + clipped, smoothed, RTN of the unsmoothed
layer) by the layer's output error on calibration samples and keeps the best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.quant.weights import WeightQuantArgs
from pagoda.quantizer.awq import fake_quantize_groups

# The candidates, best-first on ties: AWQ's full result, its scales alone, plain rounding.
CANDIDATES = ("scales+clip", "scales", "rtn")


@dataclass(frozen=True)
class RoundedTarget:
    """A linear of the layer: its attribute path and which output rows are quantized."""

    attr: str  # e.g. "self_attn.qkv_proj"
    rows: torch.Tensor  # [n] long: the quantized rows (ignored shards stay dense)


@dataclass(frozen=True)
class GuardChoice:
    """The winning candidate and every candidate's layer-output mean squared error."""

    name: str  # one of CANDIDATES
    errors: dict[str, float]

    def __post_init__(self) -> None:
        if self.name not in CANDIDATES:
            raise ValueError(f"unknown AWQ candidate {self.name!r}; one of {CANDIDATES}")


def evaluation_samples(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Indices of whole samples (token counts `lengths`), evenly spread, holding about
    `max_tokens` tokens; at least one. Attention needs whole sequences, so samples are taken,
    not tokens."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if sum(lengths) <= max_tokens:
        return list(range(len(lengths)))
    per_sample = sum(lengths) / len(lengths)
    count = max(1, min(len(lengths), round(max_tokens / per_sample)))
    step = len(lengths) / count
    return [int(i * step) for i in range(count)]


def rounded_weights(
    layer: nn.Module,
    targets: Sequence[RoundedTarget],
    args: WeightQuantArgs,
    scale_dtype: torch.dtype,
    rounded_from: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:  # attr -> [out, in] weight in the layer's dtype
    """Each target's weight with its quantized rows rounded (RTN of `rounded_from[attr]`, the
    clipped weight, where given; else of the layer's current weight)."""
    out = {}
    for t in targets:
        weight = layer.get_submodule(t.attr).weight.data
        source = (rounded_from or {}).get(t.attr, weight).to(torch.float32)
        w = weight.clone()
        w[t.rows] = fake_quantize_groups(source[t.rows], args, scale_dtype).to(w.dtype)
        out[t.attr] = w
    return out


def layer_error(
    layer: nn.Module,
    weights: dict[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    run: Callable[[nn.Module, Sequence[torch.Tensor]], list[torch.Tensor]],
) -> float:
    """Mean squared error of the layer's outputs with `weights` in place (then restored)."""
    originals = {a: layer.get_submodule(a).weight.data for a in weights}
    try:
        for attr, w in weights.items():
            layer.get_submodule(attr).weight.data = w
        with torch.no_grad():
            outputs = run(layer, inputs)
    finally:
        for attr, w in originals.items():
            layer.get_submodule(attr).weight.data = w
    total = sum(
        float((o - r).float().pow(2).sum(dtype=torch.float64)) for o, r in zip(outputs, reference)
    )
    return total / max(sum(r.numel() for r in reference), 1)


def choose(errors: dict[str, float]) -> GuardChoice:
    """The candidate of lowest error; on a tie the earlier of CANDIDATES."""
    best = min((c for c in CANDIDATES if c in errors), key=lambda c: errors[c])
    return GuardChoice(best, dict(errors))

"""Block-output refinement of GPTQ's rounding (AutoRound's sign-gradient idea, started from GPTQ).

GPTQ rounds each linear against its own input Hessian: the error it minimises is that one
linear's output error, one column at a time. What the model feels is the decoder layer's output
after attention and the MLP's nonlinearity, with every linear of the layer rounded at once.
Here each code is round(u / s + V), u the value GPTQ rounded and V in [-0.5, 0.5] an offset
per weight (0 = GPTQ's code) with a straight-through gradient, and signed gradient steps on the
layer's output error over the calibration samples move V. The scales stay GPTQ's. The result is
kept only when the layer's output error over every calibration sample is below GPTQ's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from pagoda.quant.weights import QuantizedWeight, WeightQuantArgs


@dataclass
class RefineTarget:
    """One linear of the layer: its quantized rows (`rows` of `module.weight`) and codes."""

    attr: str  # module path inside the layer
    rows: torch.Tensor  # [n] long
    quantized: QuantizedWeight  # of those rows
    unrounded: torch.Tensor  # [n, in] the values its codes round (GPTQ's updated weights)


@dataclass
class RefineReport:
    before: float  # layer output MSE with GPTQ's codes, over every calibration sample
    after: float  # with the refined codes (kept only when lower)
    changed: float  # fraction of codes that moved
    kept: bool


def _round_ste(v: torch.Tensor) -> torch.Tensor:
    return v + (torch.round(v) - v).detach()


def _layer_mse(
    layer: nn.Module,
    weights: dict[str, torch.Tensor],
    inputs: list[torch.Tensor],
    positions: list[torch.Tensor],
    reference: list[torch.Tensor],
) -> torch.Tensor:
    total = torch.zeros((), device=inputs[0].device)
    for x, pos, ref in zip(inputs, positions, reference, strict=True):
        out, residual = functional_call(layer, weights, (pos, x, None, None))
        total = total + (out + residual - ref).float().pow(2).mean()
    return total / len(inputs)


def refine_layer(
    layer: nn.Module,
    targets: list[RefineTarget],
    inputs: list[torch.Tensor],  # each sample's layer input [T, hidden]
    positions: list[torch.Tensor],  # each sample's rotary positions
    reference: list[torch.Tensor],  # each sample's float layer output [T, hidden]
    args: WeightQuantArgs,
    steps: int,
    batch: int = 16,
    lr: float = 0.1,  # how far an offset can travel over `steps` (linear decay)
    seed: int = 0,
) -> tuple[dict[str, QuantizedWeight], RefineReport]:
    """Sign-gradient steps on every target's rounding offsets; returns the codes to keep."""
    layer.requires_grad_(False)
    template = {t.attr: layer.get_submodule(t.attr).weight.detach() for t in targets}
    codes, scales, zeros, offsets = {}, {}, {}, {}
    for t in targets:
        qw = t.quantized
        g = qw.group_size
        scales[t.attr] = qw.scale.float().repeat_interleave(g, dim=1)[:, : qw.qweight.shape[1]]
        codes[t.attr] = t.unrounded / scales[t.attr]
        zeros[t.attr] = (
            None
            if qw.zero_point is None
            else qw.zero_point.float().repeat_interleave(g, dim=1)[:, : qw.qweight.shape[1]]
        )
        offsets[t.attr] = torch.zeros_like(codes[t.attr], requires_grad=True)

    def weights(round_fn) -> dict[str, torch.Tensor]:
        out = {}
        for t in targets:
            z = zeros[t.attr]
            q = round_fn(codes[t.attr] + offsets[t.attr])
            if z is not None:
                q = q + z
            q = torch.clamp(q, args.q_min, args.q_max)
            deq = (q if z is None else q - z) * scales[t.attr]
            w = template[t.attr]
            out[f"{t.attr}.weight"] = w.index_put((t.rows,), deq.to(w.dtype))
        return out

    with torch.no_grad():
        before = float(_layer_mse(layer, weights(torch.round), inputs, positions, reference))
    gen = torch.Generator().manual_seed(seed)
    n = len(inputs)
    with torch.enable_grad():
        for step in range(steps):
            idx = torch.randperm(n, generator=gen)[:batch].tolist()
            loss = _layer_mse(
                layer,
                weights(_round_ste),
                [inputs[i] for i in idx],
                [positions[i] for i in idx],
                [reference[i] for i in idx],
            )
            grads = torch.autograd.grad(loss, list(offsets.values()))
            rate = lr / steps * 2 * (1 - step / steps)  # sums to lr over the run
            with torch.no_grad():
                for v, grad in zip(offsets.values(), grads, strict=True):
                    v.sub_(rate * grad.sign()).clamp_(-0.5, 0.5)
    with torch.no_grad():
        after = float(_layer_mse(layer, weights(torch.round), inputs, positions, reference))
    moved = sum(
        int((torch.round(codes[a] + v) != torch.round(codes[a])).sum()) for a, v in offsets.items()
    )
    total = sum(v.numel() for v in offsets.values())
    kept = after < before
    result = {}
    for t in targets:
        qw = t.quantized
        if kept:
            q = torch.round(codes[t.attr] + offsets[t.attr].detach())
            if zeros[t.attr] is not None:
                q = q + zeros[t.attr]
            q = torch.clamp(q, args.q_min, args.q_max)
            qw = QuantizedWeight(q.to(qw.qweight.dtype), qw.scale, qw.zero_point, qw.group_size)
        result[t.attr] = qw
    return result, RefineReport(before, after, moved / max(total, 1), kept)

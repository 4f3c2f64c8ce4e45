"""AWQ (Lin et al., 2023) as pure functions: activation-aware channel scales and weight clipping.

Scale search, for the linears that read one op's output (q/k/v after input_layernorm, ...):
for each candidate s = x̄^α / w̄^(1-α) (x̄: mean |x| per input channel, w̄: mean of the
group-normalised |W| per channel; α on a grid over [0, 1), plus s = 1), normalised so that
max(s)·min(s) = 1, the caller measures the output error of the module the linears sit in with
weights Q(W·s)/s; the best s wins. Clipping then shrinks each group's range (max |w| × (1 - k/20))
where that lowers the group's output error on a sample of calibration tokens (opt-in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pagoda.quant.weights import WeightQuantArgs
from pagoda.quantizer.rtn import compute_qparams, fake_quantize


@dataclass(frozen=True)
class AWQOptions:
    """Search knobs (AutoAWQ's defaults)."""

    n_grid: int = 20  # scale exponents α = i / n_grid, i < n_grid
    duo_scaling: bool = True  # s = x̄^α / w̄^(1-α); False: s = x̄^α
    # Per-group clip search (AutoAWQ's apply_clip); off by default. It lowered every layer's
    # calibration output error, yet raised held-out perplexity on Qwen2.5-Coder-0.5B g128 from
    # 8.723 to 9.124 (RTN asym 8.733); on SmolLM2 g64 it helped less (13.018 -> 12.945).
    clip: bool = False
    clip_grid: int = 20  # shrink steps of 1 / clip_grid ...
    max_shrink: float = 0.5  # ... up to (not including) this fraction of max |w|
    clip_tokens: int = 512  # calibration tokens (evenly strided) the clip search looks at
    clip_rows: int = 256  # output rows per step of the clip search (bounds its memory)
    # Calibration tokens (whole samples, evenly spread) the scale searches and the per-layer
    # guard score on; the channel means x̄ use every token.
    search_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.n_grid < 1 or self.clip_grid < 1:
            raise ValueError("AWQ n_grid and clip_grid must be >= 1")
        if self.search_tokens < 1:
            raise ValueError(f"AWQ search_tokens must be >= 1, got {self.search_tokens}")
        if not 0 <= self.max_shrink < 1:
            raise ValueError(f"AWQ max_shrink must be in [0, 1), got {self.max_shrink}")


@dataclass(frozen=True)
class ScaleSearch:
    """The outcome of one scale search."""

    scales: torch.Tensor  # [in] float32; W·s and x/s
    ratio: float | None  # the winning α; None when s = 1 won
    loss: float  # output MSE with Q(W·s)/s
    initial_loss: float  # output MSE with plain rounding (s = 1)


def fake_quantize_groups(
    weight: torch.Tensor, args: WeightQuantArgs, scale_dtype: torch.dtype
) -> torch.Tensor:  # [out, in] float32: what the final rounding of `weight` would give
    """Round-to-nearest of every group, with the scale and zero point rules of `rtn`."""
    out_features, in_features = weight.shape
    group = args.group_size_for(in_features)
    rows = weight.to(torch.float32).reshape(-1, group)  # [out * groups, group]
    scale, zero = compute_qparams(rows, args, scale_dtype)
    return fake_quantize(rows, scale, zero, args).reshape(out_features, in_features)


def activation_mean(inputs: Sequence[torch.Tensor]) -> torch.Tensor:  # [in] float32
    """Mean |x| per input channel over every token of every sample (each [T, in])."""
    total = torch.zeros(inputs[0].shape[-1], dtype=torch.float32, device=inputs[0].device)
    count = 0
    for x in inputs:
        x = x.reshape(-1, x.shape[-1])
        total += x.abs().sum(dim=0, dtype=torch.float32)
        count += x.shape[0]
    return total / max(count, 1)


def weight_mean(weight: torch.Tensor, group_size: int) -> torch.Tensor:  # [in] float32
    """Mean over output rows of |w| / max |w| of its group: how large each channel's weights
    are relative to what their group's scale has to cover."""
    w = weight.to(torch.float32).abs()
    groups = w.reshape(-1, group_size)
    normalised = groups / (groups.amax(dim=1, keepdim=True) + 1e-6)
    return normalised.reshape(w.shape).mean(dim=0)


def scale_candidates(
    x_mean: torch.Tensor, w_mean: torch.Tensor, options: AWQOptions
) -> Iterator[tuple[float | None, torch.Tensor]]:
    """(α, s) pairs: s = 1 first (so AWQ never does worse than plain rounding on the
    calibration loss), then α = 0, 1/n, ..., (n-1)/n."""
    yield None, torch.ones_like(x_mean)
    for i in range(options.n_grid):
        ratio = i / options.n_grid
        if options.duo_scaling:
            s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
        else:
            s = x_mean.pow(ratio)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        yield ratio, s


def search_scales(
    weight: torch.Tensor,  # [out, in]: every linear reading the smoothed input, rows stacked
    x_mean: torch.Tensor,  # [in]
    args: WeightQuantArgs,
    loss_of: Callable[[torch.Tensor], float],
    options: AWQOptions,
    scale_dtype: torch.dtype,
) -> ScaleSearch:
    """The s minimising `loss_of(Q(W·s)/s)`, the caller's output error of the module with
    those weights in place of W (so s never has to be applied to the previous op to try it)."""
    w = weight.to(torch.float32)
    w_mean = weight_mean(w, args.group_size_for(w.shape[1]))
    best: ScaleSearch | None = None
    initial = float("nan")
    for ratio, s in scale_candidates(x_mean.to(torch.float32), w_mean, options):
        candidate = fake_quantize_groups(w * s, args, scale_dtype) / s
        loss = loss_of(candidate.to(weight.dtype))
        if ratio is None:
            initial = loss
        if best is None or loss < best.loss:
            best = ScaleSearch(s, ratio, loss, initial)
    assert best is not None
    return ScaleSearch(best.scales, best.ratio, best.loss, initial)


def search_clip(
    weight: torch.Tensor,  # [out, in]
    inputs: torch.Tensor,  # [N, in] calibration inputs of this linear
    args: WeightQuantArgs,
    options: AWQOptions,
    scale_dtype: torch.dtype,
) -> torch.Tensor:  # [out, groups] float32: clip each group to [-m, m]
    """Per group, the max |w| (shrunk by k / clip_grid, k < max_shrink · clip_grid) whose
    rounding gives the lowest mean squared error of the group's share of the output."""
    out_features, in_features = weight.shape
    group = args.group_size_for(in_features)
    num_groups = in_features // group
    step = max(1, inputs.shape[0] // options.clip_tokens)
    x = inputs[::step].reshape(-1, num_groups, group)  # [n, groups, G], the inputs' dtype
    best_all = []
    for r0 in range(0, out_features, options.clip_rows):
        w = weight[r0 : r0 + options.clip_rows].to(torch.float32)
        w = w.reshape(-1, num_groups, group)  # [o, groups, G]
        full = w.abs().amax(dim=-1)  # [o, groups]
        best_max = full.clone()
        best_err = torch.full_like(full, float("inf"))
        for k in range(int(options.max_shrink * options.clip_grid)):
            limit = full * (1 - k / options.clip_grid)
            clipped = torch.maximum(torch.minimum(w, limit[..., None]), -limit[..., None])
            q = fake_quantize_groups(clipped.reshape(w.shape[0], -1), args, scale_dtype)
            # The output error (Q - W) x in one product, in the inputs' dtype (bf16 inputs:
            # the CPU's bf16 GEMM; the difference keeps its relative precision).
            diff = (q.reshape(w.shape) - w).to(x.dtype)
            err = torch.einsum("ogk,ngk->ong", diff, x).float().pow(2).mean(dim=1)  # [o, groups]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, limit, best_max)
        best_all.append(best_max)
    return torch.cat(best_all)


def apply_clip(weight: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:  # [out, in]
    """`weight` with each group clamped to [-max_val, max_val] ([out, groups])."""
    out_features, in_features = weight.shape
    groups = max_val.shape[1]
    w = weight.reshape(out_features, groups, in_features // groups)
    m = max_val.to(weight.dtype)[..., None]
    return torch.maximum(torch.minimum(w, m), -m).reshape(out_features, in_features)

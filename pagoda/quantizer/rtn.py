"""Round-to-nearest quantization and the scale / zero-point rules GPTQ shares.

Scales and zero points follow compressed-tensors' min-max observer: the range always holds 0;
symmetric scale = max|w| / ((q_max - q_min) / 2) (7.5 for int4), asymmetric scale =
(max - min) / (q_max - q_min) with zero point q_min - min / scale. The scale is rounded to the
dtype it is stored in before any code is computed, so stored codes and scales agree exactly.
"""

from __future__ import annotations

import torch

from pagoda.quant.weights import QuantizedWeight, WeightQuantArgs


def compute_qparams(
    w: torch.Tensor,  # [out, cols] the columns of one group
    args: WeightQuantArgs,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # scale [out] (float32 values), zero [out] | None
    """Min-max scale (rounded to `scale_dtype`) and zero point of each row of `w`."""
    w = w.to(torch.float32)
    return _range_qparams(w.amin(dim=1), w.amax(dim=1), args, scale_dtype)


def _range_qparams(
    lo: torch.Tensor,  # [...] each row's minimum
    hi: torch.Tensor,  # [...] each row's maximum
    args: WeightQuantArgs,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_qparams` from each row's range (widened to hold 0)."""
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    q_range = float(args.q_max - args.q_min)
    if args.symmetric:
        scale = torch.maximum(lo.abs(), hi) / (q_range / 2)
    else:
        scale = (hi - lo) / q_range
    scale = scale.to(scale_dtype)
    # A zero scale (an all-zero row) would divide by zero: use the dtype's epsilon instead.
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale).to(torch.float32)
    if args.symmetric:
        return scale, None
    zero = torch.round(args.q_min - lo / scale).clamp(args.q_min, args.q_max)
    return scale, zero


def search_qparams(
    w: torch.Tensor,  # [out, cols] the columns of one group
    args: WeightQuantArgs,
    scale_dtype: torch.dtype,
    importance: torch.Tensor | None = None,  # [cols] weight of each column's error (diag H)
    grid: int = 100,
    max_shrink: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # scale [out], zero [out] | None
    """`compute_qparams` of the range shrunk by 1 - k / grid (k <= max_shrink * grid), per row
    the shrink whose rounding has the lowest importance-weighted squared error.

    Min-max spends the whole 4-bit grid on the outermost weight; clipping it a little
    rounds the many inner weights more finely (the GPTQ reference's MSE quantizer)."""
    w = w.to(torch.float32)
    out_features, cols = w.shape
    imp = torch.ones(cols, device=w.device) if importance is None else importance.float()
    shrink = 1 - torch.arange(int(max_shrink * grid) + 1, device=w.device) / grid  # [K], 1 first
    # The range of w * s is (min w * s, max w * s) exactly (s > 0; rounding is monotonic), so
    # the K candidates' scales come from the row ranges without scaling every weight.
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scale, zero = _range_qparams(lo * shrink[:, None], hi * shrink[:, None], args, scale_dtype)
    # Each candidate rounds the original weights: [K, out, cols], in chunks of candidates (on
    # a CPU small enough to stay in cache: a 9728-row group is 21 x 5 MB; on a GPU one chunk
    # holds every candidate of most groups, so a group stays a few launches). fake_quantize
    # in place on one temporary: its allocating form measured 1.5-2x slower here on the CPU.
    err = torch.empty(shrink.shape[0], out_features, device=w.device)
    budget = 1 << (26 if w.is_cuda else 22)  # float32 elements a chunk
    step = max(1, budget // max(1, out_features * cols))
    for k0 in range(0, shrink.shape[0], step):
        k1 = min(k0 + step, shrink.shape[0])
        s_k = scale[k0:k1, :, None]
        z_k = None if zero is None else zero[k0:k1, :, None]
        q = torch.round(w[None] / s_k if z_k is None else w[None] / s_k + z_k)
        q = q.clamp_(args.q_min, args.q_max)
        if z_k is not None:
            q = q.sub_(z_k)
        d = q.mul_(s_k).sub_(w[None])  # dequantized - original
        err[k0:k1] = (d.pow_(2) * imp).sum(dim=2)
    best = err.argmin(dim=0)  # [out]; ties: the smaller shrink
    rows = torch.arange(out_features, device=w.device)
    return scale[best, rows], None if zero is None else zero[best, rows]


def quantize_codes(
    w: torch.Tensor,  # [out, cols]
    scale: torch.Tensor,  # [out] or [out, cols]
    zero: torch.Tensor | None,
    args: WeightQuantArgs,
) -> torch.Tensor:  # [out, cols] float32 integer values
    if scale.dim() == 1:
        scale = scale[:, None]
        zero = None if zero is None else zero[:, None]
    q = w.to(torch.float32) / scale
    if zero is not None:
        q = q + zero
    return torch.round(q).clamp(args.q_min, args.q_max)


def fake_quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightQuantArgs
) -> torch.Tensor:  # [out, cols] float32: dequantize(quantize(w))
    if scale.dim() == 1:
        scale = scale[:, None]
        zero = None if zero is None else zero[:, None]
    q = quantize_codes(w, scale, zero, args)
    if zero is not None:
        q = q - zero
    return q * scale


def rtn_quantize(
    weight: torch.Tensor,  # [out, in]
    args: WeightQuantArgs,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedWeight:
    """Round every weight to its group's nearest code (no calibration data)."""
    out_features, in_features = weight.shape
    group = args.group_size_for(in_features)
    scales, zeros, codes = [], [], []
    for start in range(0, in_features, group):
        cols = weight[:, start : start + group]
        scale, zero = compute_qparams(cols, args, scale_dtype)
        codes.append(quantize_codes(cols, scale, zero, args))
        scales.append(scale)
        zeros.append(zero)
    return QuantizedWeight(
        qweight=torch.cat(codes, dim=1).to(torch.int8),
        scale=torch.stack(scales, dim=1).to(scale_dtype),
        zero_point=None if args.symmetric else torch.stack(zeros, dim=1).to(torch.int8),
        group_size=group,
    )


def hessian_weighted_error(
    weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor | None
) -> float:
    """tr((W - Q) H (W - Q)^T): the layer-output error GPTQ minimises, summed over rows.

    `hessian` None stands for H = I (no calibration data): the plain squared error, without
    the [in, in] product."""
    d = weight.to(torch.float32) - dequantized.to(torch.float32)  # [out, in]
    if hessian is None:
        return float(d.pow(2).sum(dtype=torch.float64))
    return float(((d @ hessian.to(torch.float32)) * d).sum(dtype=torch.float64))

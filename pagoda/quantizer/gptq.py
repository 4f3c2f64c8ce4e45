"""GPTQ (Frantar et al., 2022) as pure functions on a weight [out, in] and its Hessian [in, in].

H = 2 X Xᵀ / N; dampening adds percdamp × mean(diag H); dead columns are zeroed; the upper
Cholesky factor of H⁻¹ drives column-by-column rounding with error feedback inside blocks of
`block_size` columns. Static act-order visits columns by decreasing diag(H) while groups stay in
the original column order (compressed-tensors `actorder: static`: no g_idx is stored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagoda.quant.weights import QuantizedWeight, WeightQuantArgs
from pagoda.quantizer.rtn import fake_quantize, quantize_codes, search_qparams


class HessianAccumulator:
    """Running H = 2 X Xᵀ / N for one linear input; float32 (or float64) whatever x's dtype.

    Inputs are buffered up to `chunk_tokens` rows and multiplied as one chunk: each update
    reads and writes all of H (94 MB for a 4864-wide input), so one per 256-token sample made
    the accumulation memory-bound; a tall chunk is also a more efficient GEMM.
    """

    def __init__(
        self,
        in_features: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        chunk_tokens: int = 4096,
    ) -> None:
        self._hessian = torch.zeros(in_features, in_features, device=device, dtype=dtype)
        self.num_tokens = 0
        self.chunk_tokens = chunk_tokens
        self._pending: list[torch.Tensor] = []  # each [n, in], not yet in H
        self._pending_tokens = 0

    def add(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:  # x [..., in]
        """Add the rows of x; `weight` [...] (x's leading shape): each row's weight w_t in
        H = 2 Σ_t w_t x_t x_tᵀ / N (default 1)."""
        x = x.reshape(-1, x.shape[-1])  # [n, in]
        if x.shape[0] == 0:
            return
        if weight is not None:
            root = weight.reshape(-1, 1).to(device=x.device, dtype=torch.float32).sqrt()
            x = x.to(torch.float32) * root
        self._pending.append(x)
        self._pending_tokens += x.shape[0]
        if self._pending_tokens >= self.chunk_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        x = torch.cat(self._pending)  # [n, in]
        self._pending, self._pending_tokens = [], 0
        total = self.num_tokens + x.shape[0]
        # Keep the running mean (not the sum) so float32 never sees huge magnitudes.
        self._hessian.mul_(self.num_tokens / total)
        if _half_gemm_to_float32(x, self._hessian):
            # bf16 / fp16 inputs: each product of two 8- or 11-bit mantissas is exact in
            # float32; the tensor cores' float32 accumulation is not IEEE (H200: 13x / 43x
            # the float32 GEMM's error for bf16 / fp16, ~1e-5 of the largest entry), far
            # below the sampling noise of H itself (~1 % at 16k tokens). 13x faster on the
            # 18944-wide input of a 7B down_proj, where X^T X was most of a layer's time.
            self._hessian.add_(torch.mm(x.t(), x, out_dtype=torch.float32), alpha=2.0 / total)
        else:
            x = x.to(self._hessian.dtype)
            self._hessian.addmm_(x.t(), x, alpha=2.0 / total)
        self.num_tokens = total

    @property
    def hessian(self) -> torch.Tensor:  # [in, in]
        self._flush()
        return self._hessian


def _half_gemm_to_float32(x: torch.Tensor, hessian: torch.Tensor) -> bool:
    """Whether X^T X can run as a bf16 / fp16 GEMM with a float32 result (CUDA only: the CPU
    has no mixed-dtype mm)."""
    return (
        x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and hessian.dtype == torch.float32
    )


@dataclass
class GPTQResult:
    quantized: QuantizedWeight
    dequantized: torch.Tensor  # [out, in] float32, in the original column order
    loss: float  # GPTQ's Σ err² / (2 [H⁻¹]_jj²) proxy, as llmcompressor reports it
    used_rtn_fallback: bool  # the Hessian could not be factorised even with more dampening
    # [out, in] float32, original column order: each weight as GPTQ rounded it (the original
    # plus the error updates of the columns before it); its codes are round(unrounded / s) + z.
    # Only with keep_unrounded (a copy per column GPTQ's inner loop otherwise skips)
    unrounded: torch.Tensor | None = None


def _inverse_cholesky_upper(h: torch.Tensor, dampening: float) -> tuple[torch.Tensor, bool]:
    """Upper Cholesky factor of (H + damp I)⁻¹; retries with 10× dampening, then gives up."""
    mean_diag = torch.mean(torch.diag(h))
    for attempt in range(4):
        damp = dampening * (10**attempt) * mean_diag
        hd = h.clone()
        hd.diagonal().add_(damp)
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return upper, False
    return torch.eye(h.shape[0], dtype=h.dtype, device=h.device), True


def gptq_quantize(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in], 2 X Xᵀ / N
    args: WeightQuantArgs,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype = torch.bfloat16,
    scales: str = "first_touch",
    keep_unrounded: bool = False,
) -> GPTQResult:
    """Quantize `weight` with GPTQ; `args.actorder` None or "static".

    scales: "first_touch" computes a group's scale when GPTQ reaches the group's first column,
    from the error-updated weights; "upfront" computes every scale from the original weights
    before any column is quantized (what llmcompressor 0.14 does with its observer).
    """
    if scales not in ("first_touch", "upfront"):
        raise ValueError(f"scales must be 'first_touch' or 'upfront', got {scales!r}")
    if args.actorder not in (None, "static", "weight"):
        raise ValueError(f"GPTQ supports actorder None or 'static', got {args.actorder!r}")
    out_features, in_features = weight.shape
    group = args.group_size_for(in_features)
    num_groups = math.ceil(in_features / group)
    device = weight.device
    w = weight.to(torch.float32).clone()  # [out, in] working copy, updated in place
    h = hessian.to(torch.float32).clone()

    dead = torch.diag(h) == 0
    if bool(dead.any()):
        # A column no calibration token touched: its weight cannot matter, quantize it as 0.
        h[dead, dead] = 1.0
        w[:, dead] = 0.0

    perm = None
    if args.actorder is not None:
        perm = torch.argsort(torch.diag(h), descending=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    importance = torch.diag(h).clone()  # [in] (permuted): how much each column's error costs
    u, used_rtn = _inverse_cholesky_upper(h, dampening)  # [in, in] upper
    del h

    # Group of each (permuted) column: groups are defined in the original column order.
    original_col = perm if perm is not None else torch.arange(in_features, device=device)
    col_group = (original_col // group).tolist()
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for pos, g in enumerate(col_group):
        members[g].append(pos)
    members_t = [torch.tensor(m, device=device) for m in members]
    scale = torch.zeros(out_features, num_groups, device=device)
    zero = None if args.symmetric else torch.zeros(out_features, num_groups, device=device)
    ready = [False] * num_groups
    if scales == "upfront":
        for g, cols in enumerate(members_t):
            s, z = search_qparams(w[:, cols], args, scale_dtype, importance[cols])
            scale[:, g] = s
            if zero is not None:
                zero[:, g] = z
            ready[g] = True

    loss = torch.zeros((), device=device, dtype=torch.float64)
    unrounded = torch.empty_like(w) if keep_unrounded else None
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        w1 = w[:, i1:i2].clone()  # [out, B]
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = col_group[i1 + i]
            if not ready[g]:
                # First column of group g: its scale comes from the group's current weights.
                # Columns in this block already hold the in-block updates; later blocks still
                # lack this block's pending update err1[:, :i] @ u[i1:i1+i, cols].
                cols = members_t[g]
                current = w[:, cols]
                in_block = (cols >= i1 + i) & (cols < i2)
                if bool(in_block.any()):
                    current[:, in_block] = w1[:, cols[in_block] - i1]
                later = cols >= i2
                if bool(later.any()) and i > 0:
                    current[:, later] -= err1[:, :i] @ u[i1 : i1 + i, cols[later]]
                s, z = search_qparams(current, args, scale_dtype, importance[cols])
                scale[:, g] = s
                if zero is not None:
                    zero[:, g] = z
                ready[g] = True
            col = w1[:, i]
            q = fake_quantize(
                col[:, None], scale[:, g], None if zero is None else zero[:, g], args
            )[:, 0]
            q1[:, i] = q
            if unrounded is not None:
                unrounded[:, i1 + i] = col
            e = (col - q) / u1[i, i]
            err1[:, i] = e
            # Spread this column's rounding error over the block's remaining columns.
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
        w[:, i1:i2] = q1
        loss += (err1.to(torch.float64) ** 2).sum() / 2
        if i2 < in_features:
            w[:, i2:] -= err1 @ u[i1:i2, i2:]

    if perm is not None:
        inverse = torch.argsort(perm)
        w = w[:, inverse]
        unrounded = None if unrounded is None else unrounded[:, inverse]
    # Recover the codes from the dequantized values: exact, they are (q - z) * s.
    col_scale = scale.repeat_interleave(group, dim=1)[:, :in_features]
    col_zero = None if zero is None else zero.repeat_interleave(group, dim=1)[:, :in_features]
    codes = quantize_codes(w, col_scale, col_zero, args)
    quantized = QuantizedWeight(
        qweight=codes.to(torch.int8),
        scale=scale.to(scale_dtype),
        zero_point=None if zero is None else zero.to(torch.int8),
        group_size=group,
    )
    return GPTQResult(quantized, w, float(loss), used_rtn, unrounded)

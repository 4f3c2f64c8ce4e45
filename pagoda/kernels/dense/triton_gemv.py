"""Split-K GEMV for dense bf16/fp16 weights at M = 1 (batch-1 decode): y = x @ W^T (+ bias).

Why not cuBLAS: on the H200 profile of a Qwen2.5-7B decode step (`benchmarks/results/
profile_h200_async/`, BENCHMARKS.md "Batch-1 decode") cuBLAS streams the wide gate_up layer
near the copy bandwidth but falls well short on qkv and o_proj (a split-K GEMV plus a separate
reduction kernel). Those two are small (25-33 MB): what they need is many programs in flight at
once and one kernel per GEMV. Here:

- a program owns BLOCK_N output rows and one K-slice; its [BLOCK_N, BLOCK_K] weight tiles
  (contiguous along K in nn.Linear's [N, K] layout: 16-byte vector loads) stream through the
  software pipeline; products accumulate elementwise in fp32 and are summed over K once at the
  end (no per-tile reductions);
- split-K partials meet in the same self-cleaning "serial" reduction as the W4A16 GEMV
  (`workspace.SplitKWorkspace`: atomics into an fp32 workspace, the last program of a
  column tile reads the sums back with atomic exchanges, adds the bias, stores in the output
  dtype and resets its counter): one kernel per GEMV, CUDA-graph capturable;
- programmatic dependent launch (`pagoda/kernels/pdl.py`): the GEMV launches while the
  preceding norm / attention kernel finishes.

`gemv_bf16` is used by `UnquantizedLinearMethod` for every M = 1 layer on sm_90+ unless
`PAGODA_DISABLED_KERNELS` lists "dense_gemv" (`pagoda/layers/linear.py`); `gemv_ref` is the
torch reference. In the H200 sweep the winning shape was the opposite of the W4A16 GEMV's: 8 rows x
512 columns per program and no split-K at all (see `default_dense_gemv_config`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda import platform
from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.workspace import SplitKWorkspace


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    N, K, k_per_split, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        if EVEN_N and EVEN_K:
            w = tl.load(rows + k[None, :])
            x = tl.load(x_ptr + k)
        elif EVEN_K:
            w = tl.load(rows + k[None, :], mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptr + k)
        else:
            w = tl.load(rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if USE_PDL:  # every weight tile is read: the next kernel may launch (it waits for us)
        tl.extra.cuda.gdc_launch_dependents()
    col = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if ONE_SPLIT:
        if HAS_BIAS:
            col += bias
        tl.store(
            out_ptr + offs_n,
            col.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
            mask=mask_n,
        )
    else:
        tl.atomic_add(ws_ptr + offs_n, col, mask=mask_n, sem="relaxed")
        # Every thread's partial is issued before one thread's acq_rel increment; the last
        # program of this column tile reads the complete sums (and leaves zeros behind).
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            bits = tl.atomic_xchg(
                wsi_ptr + offs_n, tl.zeros_like(col).to(tl.int32), mask=mask_n, sem="relaxed"
            )
            total = bits.to(tl.float32, bitcast=True)
            if HAS_BIAS:
                total += bias
            tl.store(
                out_ptr + offs_n,
                total.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
                mask=mask_n,
            )
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 8
    block_k: int = 512
    split_k: int = 1  # 0: chosen from the shape (see `_plan`)
    num_warps: int = 4
    num_stages: int = 3


def default_dense_gemv_config(n: int, k: int) -> DenseGemvConfig:
    """[8, 512] tiles (8 KiB of bf16 per stage, 4 warps: two 16-byte loads per thread), no
    split-K: many short programs; the best-measured config on every Qwen2.5-3B/7B decode
    shape (H200 sweep, BENCHMARKS.md)."""
    return DenseGemvConfig()


@functools.lru_cache(maxsize=512)
def _plan(n: int, k: int, cfg: DenseGemvConfig, num_sms: int) -> tuple[int, int, int]:
    """(n_tiles, split, k_per_split)."""
    n_tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = cfg.split_k
    if split <= 0:
        split = max(1, min(round(4 * num_sms / n_tiles), k_tiles // 2))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    return n_tiles, triton.cdiv(k, k_per_split), k_per_split


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 accumulation of x [1, K] @ w[N, K]^T (+ bias), cast to x's dtype."""
    out = x.float() @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv_bf16(
    x: torch.Tensor,  # [1, K] bf16 / fp16
    w: torch.Tensor,  # [N, K], same dtype, unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    config: DenseGemvConfig | None = None,
    out_dtype: torch.dtype | None = None,  # e.g. float32 logits: rounded to x's dtype first
    workspace: SplitKWorkspace | None = None,  # split-K configs only (None: cuBLAS for them)
) -> torch.Tensor:  # [1, N]
    """x @ w^T (+ bias), accumulated in fp32 and rounded once to x's dtype (as cuBLAS does);
    `out_dtype` only widens the stored result (no second kernel for `.float()`)."""
    m, k = x.shape
    n = w.shape[0]
    if m != 1:
        raise ValueError(f"gemv_bf16 handles M == 1, got M={m}")
    if w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"w must be [N, {k}] with unit stride along K, got {list(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x and w must both be bf16 or fp16, got {x.dtype} and {w.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or default_dense_gemv_config(n, k)
    num_sms = platform.num_sms(x.device) if x.is_cuda else 8  # the interpreter: any count
    n_tiles, split, k_per_split = _plan(n, k, cfg, num_sms)
    out = torch.empty((1, n), device=x.device, dtype=out_dtype or x.dtype)
    if split > 1:
        bufs = None if workspace is None else workspace.buffers(x.device, n, n_tiles)
        if bufs is None:  # capturing with a too-small workspace: cuBLAS instead
            return torch.nn.functional.linear(x, w, bias).to(out.dtype)
        ws, cnt = bufs
    else:
        ws, cnt = out, out  # unused
    _gemv_kernel[(n_tiles, split)](
        x, w, bias if bias is not None else w, out, ws, ws.view(torch.int32), cnt,
        n, k, k_per_split, w.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0,
        ONE_SPLIT=split == 1,
        HAS_BIAS=bias is not None,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out

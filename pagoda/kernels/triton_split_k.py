"""The split-K epilogue shared by the Triton GEMV / small-M GEMM kernels (W4A16, FP8 weights).

A program holds the fp32 partial [BLOCK_M, BLOCK_N] of its K-slice. One split: stored directly
(+ bias). Otherwise the partial is added into an fp32 workspace with atomics; with SERIAL (a
`SplitKWorkspace`, kernels/workspace.py) the last program of the column tile — an atomic counter
per tile — reads the sums back with atomic exchanges that leave zeros, adds the bias, stores the
output and resets the counter, so workspace and counters are zero between calls: one kernel,
no host sync, CUDA-graph capturable. Without SERIAL the caller casts the zeroed buffer it passed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_split_k(
    acc, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, b_ptr,
    offs_m, offs_n, mask_m, mask_n, N, stride_om, tile,
    ONE_SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    mask_out = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if ONE_SPLIT:
        if HAS_BIAS:
            acc += bias[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask_out, sem="relaxed")
        if SERIAL:
            # Every thread's partial is issued before one thread's acq_rel increment (the
            # CUTLASS split-K semaphore pattern); the last program reads the complete sums.
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if done == tl.num_programs(1) - 1:
                # Read and zero in one atomic (on the int32 view of the workspace).
                wsi_ptrs = wsi_ptr + offs_m[:, None] * N + offs_n[None, :]
                bits = tl.atomic_xchg(
                    wsi_ptrs, tl.zeros_like(acc).to(tl.int32), mask=mask_out, sem="relaxed"
                )
                total = bits.to(tl.float32, bitcast=True)
                if HAS_BIAS:
                    total += bias[None, :]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")

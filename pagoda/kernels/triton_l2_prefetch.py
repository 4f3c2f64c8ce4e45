"""Bulk L2 prefetch of byte ranges from inside a latency-bound kernel (sm_90+).

`prefetch_ranges` is called by a short kernel (the fused decode attention, before its wait or
after its own work) with a [R, 2] int64 table of (address, bytes) — the weights the next kernels
of the chain will read (`worker/l2_prefetch.PrefetchPlan`). Thread 0 of every program issues its
share of `cp.async.bulk.prefetch.L2.global` over CHUNK-byte pieces: the pieces of all ranges are
numbered in range order and piece i goes to program i mod P, so they leave roughly in range
order and every program gets about as many. The thread goes on without waiting: the copy engine
streams the bytes into the L2 while the kernel runs, and nothing in the kernel depends on them.
A prefetch is only a hint — results never change, only where later loads hit. R is a run-time
value (one compiled kernel for every plan).

Weights are never written by the chain, so the prefetch needs no ordering against earlier
kernels: it may be issued before `gdc_wait`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 16-byte aligned address ($1), a size in bytes, a multiple of 16 ($2); only thread 0 of the
# program issues, and only a positive size. The output is unused (`is_pure=False` keeps it).
_PREFETCH_ASM = tl.constexpr(
    """{
.reg .pred p;
.reg .u32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
setp.gt.and.s32 p, $2, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
)


@triton.jit
def prefetch_l2(addr, nbytes):
    """One bulk prefetch (thread 0 of the program) of `nbytes` (a multiple of 16) at `addr` (a
    16-byte aligned pointer or int64 address)."""
    a = tl.zeros([1], dtype=tl.int64) + addr.to(tl.int64, bitcast=addr.dtype.is_ptr())
    size = tl.zeros([1], dtype=tl.int32) + nbytes
    tl.inline_asm_elementwise(
        _PREFETCH_ASM, "=r,l,r", [a, size], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_ranges(ranges_ptr, num_ranges, pid, num_programs, CHUNK: tl.constexpr):
    """Program `pid` of `num_programs` issues its pieces of the `num_ranges` (address, bytes)
    rows at `ranges_ptr` (int64; addresses and sizes multiples of 16)."""
    first = pid.to(tl.int64)  # this program's first piece number in the current range
    for r in range(num_ranges):
        base = tl.load(ranges_ptr + 2 * r)
        nbytes = tl.load(ranges_ptr + 2 * r + 1)
        pieces = tl.cdiv(nbytes, CHUNK)
        for c in range(first, pieces, num_programs):
            off = c * CHUNK
            prefetch_l2(base + off, tl.minimum(nbytes - off, CHUNK).to(tl.int32))
        # pieces numbered on across ranges: continue where this program's turn falls
        first = (first - pieces) % num_programs
        first = tl.where(first < 0, first + num_programs, first)

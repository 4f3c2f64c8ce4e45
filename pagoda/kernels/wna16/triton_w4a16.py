"""Triton kernels for W4A16 / W8A16: y[M, N] = x[M, K] @ dequant(W)[K, N].

The weight is `qweight_t` [K / f, N] int32 (f = 32 / bits codes per word, packed along K as in
compressed-tensors, transposed so that loads run along N). A K-tile never straddles a group
(BLOCK_K divides the group size), so the fp32 partial product is scaled once per output column.

`wna16_gemm`: dequant-GEMM; the tile's codes (u - zero, exact in bf16/fp16) go through `tl.dot`.
Small M uses split-K: each program reduces a slice of K into an fp32 buffer [SPLIT_K, M, N]
summed afterwards.

`wna16_gemv`: decode (M <= 16), bandwidth-bound: split-K over K-slices with the weight tiles
pipelined through shared memory, fields unpacked with integer masks into exact floats (no
int-to-float conversions), FMAs for 1-2 rows or `tl.dot` for more, and a one-kernel split-K
reduction (see the notes above `_wna16_gemv_kernel`).

`wna16_dequant` / `wna16_dequant_linear`: large M (from `wna16.large_m_threshold`), one
bandwidth-bound pass expands the weight into a dense [N, K] scratch in x's dtype, then cuBLAS
(see the notes above `_wna16_dequant_kernel`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagoda import platform
from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.triton_split_k import store_split_k
from pagoda.kernels.wna16.tuned_tables import gpu_entries
from pagoda.kernels.workspace import SplitKWorkspace


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk,
    stride_wk, stride_wn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped tile order: neighbouring programs share weight tiles in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Unpacking: word kw holds codes k = kw * PACK + j at bits j * BITS.
    offs_kw = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS  # [PACK]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        kw = k0 // PACK + offs_kw
        words = tl.load(
            w_ptr + kw[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=(kw[:, None] < tl.cdiv(K, PACK)) & mask_n[None, :],
            other=0,
        )  # [BLOCK_K / PACK, BLOCK_N]
        codes = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K/PACK, PACK, N]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))
        g = k0 // group_size
        if HAS_ZP:
            zero = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0.0)
            w = codes.to(tl.float32) - zero.to(tl.float32)[None, :]
        else:
            w = (codes - OFFSET).to(tl.float32)
        # Rows past K hold padding codes; x is 0 there, so they add nothing.
        part = tl.dot(x, w.to(x.dtype))  # [BLOCK_M, BLOCK_N] fp32
        if PER_CHANNEL:
            acc += part
        else:
            scale = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
            acc += part * scale.to(tl.float32)[None, :]
    if PER_CHANNEL:
        scale = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)
        acc = acc * scale.to(tl.float32)[None, :]
    out_ptrs = (
        out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def default_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> GemmConfig:
    """Tile sizes by M: split-K GEMV-like tiles for decode, MMA-sized tiles for prefill."""
    block_k = min(128 if m <= 16 else 64, group_size)
    if m <= 16:
        block_n = 64
        tiles = triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        # Enough programs to fill every SM about twice; each keeps >= 4 K-tiles to amortise.
        split = max(1, min(triton.cdiv(2 * num_sms, tiles), k_tiles // 4))
        return GemmConfig(16, block_n, block_k, split, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmConfig(64 if m > 32 else 32, 128, block_k, 1, num_warps=4, num_stages=4)
    return GemmConfig(128, 128, block_k, 1, num_warps=8, num_stages=3)


def _num_sms(device: torch.device) -> int:
    """SMs of `device` (`platform.num_sms`); a small count under the CPU interpreter."""
    return platform.num_sms(device) if device.type == "cuda" else 8


def wna16_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (offset + zero point), None when symmetric
    group_size: int,
    bits: int = 4,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    m, k = x.shape
    n = qweight_t.shape[1]
    per_channel = group_size >= k
    if not per_channel and group_size % 16:
        raise ValueError(
            f"the Triton W{bits}A16 GEMM needs a group size multiple of 16, got {group_size}"
        )
    if config is None and x.is_cuda:
        config = tuned_gemm_config(_device_name(x.device.index or 0), m, n, k, group_size, bits)
    if config is None:
        num_sms = _num_sms(x.device)
        config = default_config(m, n, k, group_size if not per_channel else 128, num_sms)
    block_k = config.block_k
    if not per_channel and group_size % block_k:
        block_k = group_size  # a K-tile must stay inside one group
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    z = zeros_t if zeros_t is not None else scales_t
    _wna16_gemm_kernel[grid](
        x, qweight_t, scales_t, z, out,
        m, n, k, group_size if not per_channel else k, k_per_split,
        x.stride(0), x.stride(1),
        qweight_t.stride(0), qweight_t.stride(1),
        scales_t.stride(0), scales_t.stride(1),
        z.stride(0), z.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BITS=bits,
        HAS_ZP=zeros_t is not None,
        PER_CHANNEL=per_channel,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split == 1:
        return out[0]
    return out.sum(dim=0).to(x.dtype)


# ---------------------------------------------------------------- split-K GEMV for small M
#
# Decode (M <= 16) is bound by reading the weight once, so the GEMV is laid out for bandwidth
# and few ALU ops per weight. A program owns BLOCK_N output columns and one K-slice; its weight
# tiles [BLOCK_K / f, BLOCK_N] int32 (contiguous along N in `qweight_t`) stream through a
# software pipeline (`tl.range(num_stages=...)`: cp.async into shared memory on sm_80+).
#
# Unpacking without int->float conversions (I2F runs at 1/4 rate): field j of a word sits at bits
# [b*j, b*j + b). For the fields that fit in the fp32 mantissa (j < 23 // b) it is masked in
# place and OR-ed with an exponent chosen so that the float reads 2^(23 - b*j) + u exactly;
# the high fields use one shift per word. Subtracting 2^(23 - b*j) + zero (zero = 2^(b-1) when
# symmetric) leaves u - zero exactly: one LOP3 + one FADD per weight, then one FFMA per weight
# and row of x (FMA path; with zero points it subtracts only 2^(23 - b*j) and takes
# zero * sum(x) off per column) or a tensor-core `tl.dot` on the exact small integers (dot path,
# for several rows). The exponent constant reaches the kernel as a runtime argument (`magic`)
# so that LLVM cannot split the AND/OR into two instructions (measured in the sm_90 SASS).
#
# Split-K: each program adds its fp32 partial [M, BLOCK_N] into a zero fp32 workspace with
# atomics. "serial" reduction: the last program of a column tile (an atomic counter) reads the
# sums back with atomic exchanges (leaving zeros), writes the output in x's dtype and resets
# the counter, so the workspace and counters are all zero between calls: one kernel per GEMV,
# no host sync, CUDA-graph capturable (the buffers are allocated once outside capture).
# "atomic" reduction: a fresh zeroed fp32 buffer per call and a cast afterwards (3 kernels).
# split_k == 1 stores the output directly.

_GEMV_MAX_M = 16


@triton.jit(do_not_specialize=["M"])  # M == 1 would become a constexpr: one code path for all M
def _wna16_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    magic, hshift,
    M, N, K, k_per_split,
    stride_xm, stride_wk, stride_sg, stride_zg, stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # group size (a multiple of BLOCK_K), unused when PER_CHANNEL
    PER_CHANNEL: tl.constexpr,
    HAS_ZP: tl.constexpr,
    X_KIND: tl.constexpr,  # FMA path: 0 bf16 / 1 fp16 as int32 pairs, 2 fp32; dot path: unused
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # out = x @ W^T + bias (the bias added once, in fp32)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    IN_PLACE: tl.constexpr = 23 // BITS  # fields unpacked in place; the rest from `hi`
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    BKW: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kw = tl.arange(0, BKW)
    mask_n = offs_n < N
    mask_m = offs_m < M
    kw_total = tl.cdiv(K, PACK)

    zero = tl.zeros([BLOCK_N], dtype=tl.float32) + OFFSET  # u - zero; per column when HAS_ZP
    if PER_CHANNEL and HAS_ZP:
        zero = tl.load(z_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kw = k0 // PACK + offs_kw
        w_ptrs = w_ptr + kw[:, None] * stride_wk + offs_n[None, :]
        if EVEN_N and EVEN_K:
            words = tl.load(w_ptrs)
        elif EVEN_K:
            words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        elif EVEN_N:
            words = tl.load(w_ptrs, mask=(kw < kw_total)[:, None], other=0)
        else:
            words = tl.load(w_ptrs, mask=(kw < kw_total)[:, None] & mask_n[None, :], other=0)
        hi = words >> hshift
        if not PER_CHANNEL:
            g = k0 // GROUP
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZP:
                zero = tl.load(z_ptr + g * stride_zg + offs_n, mask=mask_n, other=0.0).to(
                    tl.float32
                )
        if USE_DOT:
            # x rows (padded to BLOCK_M >= 16) times each field's [BKW, BLOCK_N] slice.
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(PACK):
                jf = j if j < IN_PLACE else j - IN_PLACE
                src = words if j < IN_PLACE else hi
                bits = (src & (MASK << (BITS * jf))) | (magic - ((BITS * jf) << 23))
                w = bits.to(tl.float32, bitcast=True) - ((1 << (23 - BITS * jf)) + zero[None, :])
                kk = k0 + offs_kw * PACK + j
                xj = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=mask_m[:, None] & (kk < K)[None, :],
                    other=0.0,
                )  # [BLOCK_M, BKW]
                if xj.dtype == tl.float32:
                    part = tl.dot(xj, w, part, input_precision="ieee")
                else:
                    part = tl.dot(xj, w.to(xj.dtype), part)
            if PER_CHANNEL:
                acc += part
            else:
                acc += part * scale[None, :]
        else:
            # One row of x at a time over the same words (the compiler shares the unpacked
            # fields between rows where registers allow; M is small on this path).
            for m in tl.static_range(BLOCK_M):
                part = tl.zeros([BKW, BLOCK_N], dtype=tl.float32)
                x_sum = tl.zeros([BKW], dtype=tl.float32)  # asymmetric: sum(x) * zero after
                x_row = x_ptr + m * stride_xm
                k_lim = tl.where(m < M, K, 0)  # rows past M read nothing
                for p in tl.static_range(PACK // 2):
                    if X_KIND == 2:
                        k_lo = k0 + offs_kw * PACK + 2 * p
                        x_lo = tl.load(x_row + k_lo, mask=k_lo < k_lim, other=0.0)
                        x_hi = tl.load(x_row + k_lo + 1, mask=k_lo + 1 < k_lim, other=0.0)
                    else:
                        # Two 16-bit activations per int32 load (K is even on this path).
                        q = k0 // 2 + offs_kw * (PACK // 2) + p
                        xp = tl.load(x_row + q, mask=2 * q < k_lim, other=0)
                        if X_KIND == 0:
                            x_lo = (xp << 16).to(tl.float32, bitcast=True)
                            x_hi = (xp & -65536).to(tl.float32, bitcast=True)
                        else:
                            x_lo = xp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                            x_hi = (
                                (xp >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                            )
                    for h in tl.static_range(2):
                        j = 2 * p + h
                        jf = j if j < IN_PLACE else j - IN_PLACE
                        src = words if j < IN_PLACE else hi
                        bits = (src & (MASK << (BITS * jf))) | (magic - ((BITS * jf) << 23))
                        xj = x_lo if h == 0 else x_hi
                        if HAS_ZP:  # u; the zero point comes in per column below
                            f = bits.to(tl.float32, bitcast=True) - (1 << (23 - BITS * jf))
                            x_sum += xj
                        else:  # u - 2^(b-1)
                            f = bits.to(tl.float32, bitcast=True) - (
                                (1 << (23 - BITS * jf)) + OFFSET
                            )
                        part += f * xj[:, None]
                col = tl.sum(part, 0)
                if HAS_ZP:
                    col -= zero * tl.sum(x_sum, 0)
                if not PER_CHANNEL:
                    col = col * scale
                if BLOCK_M == 1:
                    acc += col[None, :]
                else:
                    acc += tl.where(offs_m[:, None] == m, col[None, :], 0.0)
    if USE_PDL:  # every weight tile is read: the next kernel may launch (it waits for us)
        tl.extra.cuda.gdc_launch_dependents()
    if PER_CHANNEL:
        scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]

    store_split_k(
        acc, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, N,
        stride_om, pid_n, ONE_SPLIT, SERIAL, HAS_BIAS,
    )  # fmt: skip


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the small-M GEMV. use_dot: tensor-core path (BLOCK_M = 16) instead of FMAs.

    reduce: "serial" (fused last-program reduction, one kernel) or "atomic" (zeroed buffer +
    atomics + cast). split_k is a target; the kernel rounds the K-slice up to whole tiles.
    """

    block_n: int = 512
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 2
    num_stages: int = 3
    use_dot: bool = False
    reduce: str = "serial"


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n, at most cap."""
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def _gemv_block_k(cfg_block_k: int, k: int, group_size: int, bits: int) -> int:
    pack = 32 // bits
    per_channel = group_size >= k
    bk = cfg_block_k if per_channel else _pow2_divisor(group_size, cfg_block_k)
    return max(bk, pack)  # a power of two, >= one word, inside one group


def gemv_dot_ok(k: int, group_size: int, bits: int) -> bool:
    """Whether the tensor-core path applies: K-tiles of >= 16 words inside one group."""
    pack = 32 // bits
    return group_size >= k or _pow2_divisor(group_size, 1 << 30) >= 16 * pack


def _split_for(n_tiles: int, k: int, block_k: int, num_sms: int, waves: float = 4.0) -> int:
    k_tiles = triton.cdiv(k, block_k)
    target = max(1, round(waves * num_sms / max(n_tiles, 1)))
    # Keep >= 4 K-tiles per program so that the pipeline's prologue stays amortised.
    return max(1, min(target, k_tiles // 4))


def default_gemv_config(
    m: int, n: int, k: int, group_size: int, bits: int, num_sms: int
) -> GemvConfig:
    """FMA path for M <= 2 (one FFMA per weight and row), tensor cores for more rows.

    FMA tiles: 16 B vector loads along N, the K reduction inside a thread, each activation
    serving several columns; ~8 resident warps per SM in total, many small programs with short
    K-slices (what won the H200 sweep, BENCHMARKS.md): one warp and 128 columns for N < 16384
    (256 when K >= 8192), four warps and 1024 columns for wide layers.
    """
    if m > 2 and gemv_dot_ok(k, group_size, bits):
        block_n = 128 if n >= 8192 else 64
        block_k = _gemv_block_k(128 if bits == 4 else 64, k, group_size, bits)
        split = _split_for(triton.cdiv(n, block_n), k, block_k, num_sms)
        return GemvConfig(block_n, block_k, split, num_warps=4, num_stages=3, use_dot=True)
    if n >= 16384:
        block_n, warps = 1024, 4
    else:
        block_n, warps = (256 if k >= 8192 else 128), 1
    words = 8 if m == 1 else 4
    block_k = _gemv_block_k(words * 32 // bits, k, group_size, bits)
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = round(8 * num_sms / (n_tiles * warps))
    split = max(1, min(split, k_tiles // 2))
    return GemvConfig(block_n, block_k, split, num_warps=warps, num_stages=3)


def gemv_candidate_configs(m: int, k: int, group_size: int, bits: int = 4) -> list[GemvConfig]:
    """Tile shapes the benchmark sweeps (split_k=0: the default split for that shape)."""
    cands = []
    if m <= 2:
        # (BLOCK_N, word-rows per tile, warps); fewer word-rows for M = 2 (registers)
        for block_n, words, warps in (
            (256, 8, 1),
            (512, 8, 2),
            (1024, 8, 4),
            (256, 16, 2),
            (512, 16, 4),
            (128, 8, 1),
        ):
            block_k = (words if m == 1 else words // 2) * 32 // bits
            cands.append(GemvConfig(block_n, block_k, 0, warps, 3))
    if m >= 2 and gemv_dot_ok(k, group_size, bits):
        for block_n, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
            cands.append(GemvConfig(block_n, 16 * 32 // bits, 0, warps, 3, True))
    return cands


_MAGIC = 150 << 23  # fp32 exponent field of 2^23: a field masked in place reads 2^23 + u


@dataclass(frozen=True)
class _GemvPlan:
    use_dot: bool
    block_m: int
    block_k: int
    n_tiles: int
    split: int
    k_per_split: int
    config: GemvConfig


_TUNED_PATH = Path(__file__).with_name("tuned") / "w4a16_gemv.json"


@functools.cache
def _tuned_gemv_table(gpu_name: str) -> dict[tuple[int, int, int, int], list[tuple[int, dict]]]:
    """{(n, k, group, bits): [(m, config fields), ...] sorted by m} measured on this GPU model.

    The table is the best config per shape of `benchmarks/quant/bench_w4a16_gemm.py
    --gemv-only` on that GPU (CUDA-graph timings); other GPUs and shapes use the heuristic.
    """
    return _load_tuned(_TUNED_PATH, gpu_name)


def _load_tuned(
    path: Path, gpu_name: str
) -> dict[tuple[int, int, int, int], list[tuple[int, dict]]]:
    table: dict[tuple[int, int, int, int], list[tuple[int, dict]]] = {}
    for e in gpu_entries(path, gpu_name):
        key = (e["n"], e["k"], e["group_size"], e["bits"])
        table.setdefault(key, []).append((e["m"], e["config"]))
    for rows in table.values():
        rows.sort(key=lambda r: r[0])
    return table


@functools.cache
def _tuned_gemm_table(gpu_name: str) -> dict[tuple[int, int, int, int], list[tuple[int, dict]]]:
    """Like `_tuned_gemv_table`, for the dequant-GEMM (`w4a16_gemm.json`, M = 1…512)."""
    return _load_tuned(_TUNED_PATH.with_name("w4a16_gemm.json"), gpu_name)


def tuned_gemm_config(
    gpu_name: str, m: int, n: int, k: int, group_size: int, bits: int
) -> GemmConfig | None:
    """The measured best GEMM config for the smallest tuned M >= m on this GPU, if any (M
    above the largest tuned one, e.g. long prefills, keeps the heuristic)."""
    rows = _tuned_gemm_table(gpu_name).get((n, k, group_size, bits))
    for tuned_m, fields in rows or ():
        if tuned_m >= m:
            return GemmConfig(**fields)
    return None


def tuned_gemv_config(
    gpu_name: str, m: int, n: int, k: int, group_size: int, bits: int
) -> GemvConfig | None:
    """The measured best config for the smallest tuned M >= m on this GPU, if any.

    An FMA-path entry (tuned at M <= 2) is only used for M <= 2: its tiles assume those rows.
    """
    rows = _tuned_gemv_table(gpu_name).get((n, k, group_size, bits))
    for tuned_m, fields in rows or ():
        if tuned_m >= m and (fields.get("use_dot") or m <= 2):
            return GemvConfig(**fields)
    return None


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=1024)
def _gemv_plan(
    m: int, n: int, k: int, group_size: int, bits: int, config: GemvConfig | None, num_sms: int
) -> _GemvPlan:
    if config is None:
        config = default_gemv_config(m, n, k, group_size, bits, num_sms)
    use_dot = config.use_dot and gemv_dot_ok(k, group_size, bits)
    block_k = _gemv_block_k(config.block_k, k, group_size, bits)
    if use_dot:
        block_k = max(block_k, 16 * (32 // bits))  # tl.dot needs K >= 16 (words per field)
    n_tiles = triton.cdiv(n, config.block_n)
    split = config.split_k if config.split_k > 0 else _split_for(n_tiles, k, block_k, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty K-slices
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    return _GemvPlan(use_dot, block_m, block_k, n_tiles, split, k_per_split, config)


def gemv_launch_info(
    m: int,
    n: int,
    k: int,
    group_size: int,
    bits: int,
    config: GemvConfig | None,
    num_sms: int,
) -> dict:
    """What `wna16_gemv` launches for this shape: resolved tiles, split and grid (benchmarks)."""
    plan = _gemv_plan(m, n, k, group_size, bits, config, num_sms)
    return {
        "config": plan.config,
        "use_dot": plan.use_dot,
        "block_m": plan.block_m,
        "block_k": plan.block_k,
        "split_k": plan.split,
        "k_per_split": plan.k_per_split,
        "grid": (plan.n_tiles, plan.split),
    }


def wna16_gemv(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, M <= 16
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32 (as `wna16_gemm`)
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (offset + zero point), None when symmetric
    group_size: int,
    bits: int = 4,
    config: GemvConfig | None = None,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,  # [N], added in fp32 before the cast to out_dtype
    workspace: SplitKWorkspace | None = None,  # the "serial" reduction's (None: atomics + copy)
) -> torch.Tensor:  # [M, N] in out_dtype (default: x.dtype)
    """y = x @ dequant(W).T (+ bias) for M <= 16: split-K GEMV (see the notes above the kernel)."""
    m, k = x.shape
    n = qweight_t.shape[1]
    if m == 0:
        return torch.empty((0, n), device=x.device, dtype=out_dtype or x.dtype)
    if m > _GEMV_MAX_M:
        raise ValueError(f"wna16_gemv handles M <= {_GEMV_MAX_M}, got {m}")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    if group_size < k and group_size % 8:
        raise ValueError(f"the W{bits}A16 GEMV needs a group size multiple of 8, got {group_size}")
    if qweight_t.stride(1) != 1:
        qweight_t = qweight_t.contiguous()
    if scales_t.stride(1) != 1:
        scales_t = scales_t.contiguous()
    if zeros_t is not None and zeros_t.stride(1) != 1:
        zeros_t = zeros_t.contiguous()
    num_sms = _num_sms(x.device)
    if config is None and x.is_cuda:
        config = tuned_gemv_config(_device_name(x.device.index or 0), m, n, k, group_size, bits)
    plan = _gemv_plan(m, n, k, group_size, bits, config, num_sms)
    split = plan.split

    x_kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[x.dtype]
    xk = x if x.stride(1) == 1 else x.contiguous()
    if not plan.use_dot and x_kind != 2:
        # The FMA path reads pairs of 16-bit activations as int32.
        if k % 2 or xk.stride(0) % 2 or xk.data_ptr() % 4:
            xk = torch.nn.functional.pad(x, (0, k % 2)).contiguous()
        xk = xk.view(torch.int32)

    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    serial = plan.config.reduce == "serial" and workspace is not None
    ws = cnt = None
    if split > 1 and serial:
        bufs = workspace.buffers(x.device, m * n, plan.n_tiles)
        if bufs is None:
            serial = False
        else:
            ws, cnt = bufs
    if split > 1 and not serial:
        ws = torch.zeros(m * n, device=x.device, dtype=torch.float32)
    if ws is None:  # split == 1: stored directly, the workspace arguments are unused
        ws = out if out.dtype == torch.float32 else torch.empty(0, device=x.device)
    if cnt is None:
        cnt = qweight_t
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    z = zeros_t if zeros_t is not None else scales_t
    cfg = plan.config
    _wna16_gemv_kernel[(plan.n_tiles, split)](
        xk, qweight_t, scales_t, z, bias if bias is not None else scales_t,
        out, ws, ws.view(torch.int32), cnt,
        _MAGIC, bits * (23 // bits),
        m, n, k, plan.k_per_split,
        xk.stride(0), qweight_t.stride(0), scales_t.stride(0), z.stride(0), out.stride(0),
        BITS=bits,
        GROUP=group_size if group_size < k else 1,
        PER_CHANNEL=group_size >= k,
        HAS_ZP=zeros_t is not None,
        X_KIND=x_kind,
        USE_DOT=plan.use_dot,
        BLOCK_M=plan.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=plan.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % plan.block_k == 0,
        ONE_SPLIT=split == 1,
        SERIAL=serial,
        NUM_STAGES=cfg.num_stages,
        HAS_BIAS=bias is not None and (split == 1 or serial),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x),
    )  # fmt: skip
    if split > 1 and not serial:
        out.copy_(ws.view(m, n) if bias is None else ws.view(m, n) + bias.float())
    return out


# ---------------------------------------------------------------- dequantize, then cuBLAS (large M)
#
# From some M on (`reference.large_m_threshold`) a layer is cheaper as one pass that
# expands the packed weight into a dense [N, K] scratch matrix in x's dtype followed by cuBLAS
# (`F.linear`) than as the Triton dequant-GEMM. The pass reads N*K*bits/8 bytes (+ scales) and
# writes N*K*2, so it is bandwidth-bound and only has to keep both streams coalesced.
#
# `qweight_t` is [K / f, N] (contiguous along N) and the output [N, K] (contiguous along K), so
# a program owns a [BLOCK_K / f, BLOCK_N] tile of words = a [BLOCK_N, BLOCK_K] tile of weights:
# the words load as rows along N, are transposed as int32 (`tl.trans` of a 2-D tile: f times
# less data through shared memory than transposing the weights), then each word is unpacked
# along its own row, `[BLOCK_N, BLOCK_K / f, f]` reshaped to `[BLOCK_N, BLOCK_K]` without
# reordering: a thread holds whole words, i.e. f consecutive weights of one output row, so the
# stores run along K. BLOCK_K is a power of two dividing the group size, so a tile needs one
# scale (and zero) per column, loaded as a [BLOCK_N] vector.
#
# Values: (u - zero) * scale in fp32 is exact (|u - zero| < 2^8 times an 8- or 11-bit scale
# significand), then rounded once to x's dtype: the GPU's cvt.rn rounds to nearest even, like
# torch, so the result equals `dequantize_packed_t` bit for bit. The interpreter's fp32 -> bf16
# cast truncates, so under it (only) the kernel rounds to nearest even with integer ops.
# The sm_90 PTX of the default tile (Triton 3.9, compiled without a GPU): per thread two 16 B
# word loads, one 4 KB shared-memory transpose per program, eight 16 B stores; the symmetric
# path is narrowed by the compiler to exact int -> bf16 conversions and bf16 multiplies (one
# rounding of an exact product: the same values).
#
# PDL: the first memory access follows `gdc_wait()`; this matters beyond the inputs, because
# the scratch may be the block the previous layer's cuBLAS call is still reading. The kernel
# does not trigger its dependents early: its successor is cuBLAS, launched without PDL.


@triton.jit
def _wna16_dequant_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr,
    N, K, group_size,
    stride_wk, stride_wn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_on,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # weights along K per tile; a power of two dividing the group size
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    RTNE_BF16: tl.constexpr,  # round to bf16 with integer ops (the interpreter's cast truncates)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    BKW: tl.constexpr = BLOCK_K // PACK
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_kw = pid_k * BKW + tl.arange(0, BKW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N

    w_ptrs = w_ptr + offs_kw[:, None] * stride_wk + offs_n[None, :] * stride_wn
    if EVEN_N and EVEN_K:
        words = tl.load(w_ptrs)  # [BKW, BLOCK_N]
    else:
        mask_w = (offs_kw < tl.cdiv(K, PACK))[:, None] & mask_n[None, :]
        words = tl.load(w_ptrs, mask=mask_w, other=0)
    if PER_CHANNEL:
        g = 0
    else:
        g = (pid_k * BLOCK_K) // group_size
    scale = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
    scale = scale.to(tl.float32)

    # Word kw holds codes k = kw * PACK + j at bits j * BITS.
    shifts = tl.arange(0, PACK) * BITS
    codes = (tl.trans(words)[:, :, None] >> shifts[None, None, :]) & MASK  # [BLOCK_N, BKW, PACK]
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
    if HAS_ZP:
        zero = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0.0)
        w = (codes.to(tl.float32) - zero.to(tl.float32)[:, None]) * scale[:, None]
    else:
        w = (codes - OFFSET).to(tl.float32) * scale[:, None]
    if RTNE_BF16:
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # finite values: no int32 overflow
        val = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        val = w.to(out_ptr.dtype.element_ty)

    out_ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :]
    if EVEN_N and EVEN_K:
        tl.store(out_ptrs, val)
    else:
        tl.store(out_ptrs, val, mask=mask_n[:, None] & (offs_k < K)[None, :])


# Whether the kernel runs in the Triton interpreter (decided when `@triton.jit` ran).
_DEQUANT_INTERPRETED = not isinstance(_wna16_dequant_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class DequantConfig:
    """Tiles of `wna16_dequant`: BLOCK_N output rows x block_k weights along K per program
    (block_k: a power of two, capped by the largest power of two dividing the group size)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4


def dequant_candidate_configs() -> list[DequantConfig]:
    """Tile shapes the benchmark sweeps for the dequant pass (the default first)."""
    cands = [DequantConfig()]
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            for warps in (4, 8):
                cfg = DequantConfig(block_n, block_k, warps)
                if cfg not in cands and block_n * block_k >= 32 * 32 * warps:
                    cands.append(cfg)
    return cands


def wna16_dequant(
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32 (as `wna16_gemm`)
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (offset + zero point), None when symmetric
    group_size: int,  # <= 0 or >= K: per output channel (groups == 1)
    bits: int = 4,
    out: torch.Tensor | None = None,  # [N, K] with unit stride along K
    *,
    k: int | None = None,  # K; default out's width, else ceil(K / f) * f
    dtype: torch.dtype | None = None,  # default out's dtype, else the scales' dtype
    config: DequantConfig | None = None,
) -> torch.Tensor:  # [N, K]: the weight `F.linear(x, w)` takes
    """The dense weight w[n, k] = (u - zero) * scale, rounded once to `dtype` (see the notes
    above the kernel); bit-identical to `pagoda.kernels.wna16.reference.dequantize_packed_t`.

    Column slices of the inputs (a range of N) work as they are: the kernel takes all strides.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    pack = 32 // bits
    kw, n = qweight_t.shape
    if k is None:
        k = out.shape[1] if out is not None else kw * pack
    if triton.cdiv(k, pack) != kw:
        raise ValueError(f"qweight_t has {kw} packed rows, K={k} needs {triton.cdiv(k, pack)}")
    per_channel = group_size <= 0 or group_size >= k
    groups = 1 if per_channel else triton.cdiv(k, group_size)
    if tuple(scales_t.shape) != (groups, n):
        raise ValueError(f"scales_t must be [{groups}, {n}], got {list(scales_t.shape)}")
    if zeros_t is not None and zeros_t.shape != scales_t.shape:
        raise ValueError(f"zeros_t must be [{groups}, {n}], got {list(zeros_t.shape)}")
    cfg = config or DequantConfig()
    block_k = cfg.block_k if per_channel else _pow2_divisor(group_size, cfg.block_k)
    if block_k < pack:
        raise ValueError(
            f"wna16_dequant needs a group size multiple of {pack} for {bits} bits, got {group_size}"
        )
    if out is None:
        dtype = dtype or scales_t.dtype
        out = torch.empty((n, k), device=qweight_t.device, dtype=dtype)
    elif tuple(out.shape) != (n, k) or out.stride(1) != 1 or dtype not in (None, out.dtype):
        raise ValueError(f"out must be [{n}, {k}] with unit stride along K, in {dtype}")
    if n == 0 or k == 0:
        return out
    z = zeros_t if zeros_t is not None else scales_t
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, cfg.block_n))
    _wna16_dequant_kernel[grid](
        qweight_t, scales_t, z, out,
        n, k, k if per_channel else group_size,
        qweight_t.stride(0), qweight_t.stride(1),
        scales_t.stride(0), scales_t.stride(1),
        z.stride(0), z.stride(1),
        out.stride(0),
        BITS=bits,
        HAS_ZP=zeros_t is not None,
        PER_CHANNEL=per_channel,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % block_k == 0,
        RTNE_BF16=_DEQUANT_INTERPRETED and out.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
        **pdl_launch_args(qweight_t),
    )  # fmt: skip
    return out


# A layer's dense weight is expanded in chunks of output rows of at most this size (the
# scratch is per call, from the caching allocator; 7B gate_up = 259 MiB is one chunk, a
# quantized 152k-vocab LM head = 1 GiB three).
_DEQUANT_SCRATCH_BYTES = 512 << 20


def wna16_dequant_linear(
    x: torch.Tensor,  # [M, K]
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (offset + zero point), None when symmetric
    group_size: int,
    bits: int = 4,
    max_scratch_bytes: int = _DEQUANT_SCRATCH_BYTES,
    config: DequantConfig | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """y = x @ dequant(W).T for large M: `wna16_dequant` into a scratch weight, then cuBLAS.

    The scratch comes from `torch.empty` per call: the profiling forward counts it in the peak
    activation memory, and under CUDA-graph capture it is allocated from the graph's pool (the
    capture keeps the block; graphs captured into one shared pool reuse it). Weights larger
    than `max_scratch_bytes` go in chunks of output rows, each GEMM writing its output columns.
    """
    m, k = x.shape
    n = qweight_t.shape[1]
    if m == 0:
        return torch.empty((0, n), device=x.device, dtype=x.dtype)
    rows = max(64, max_scratch_bytes // (k * x.element_size()) // 64 * 64)  # whole tiles
    if rows >= n:
        w = wna16_dequant(
            qweight_t, scales_t, zeros_t, group_size, bits, k=k, dtype=x.dtype, config=config
        )
        return torch.nn.functional.linear(x, w)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    scratch = torch.empty((rows, k), device=x.device, dtype=x.dtype)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = wna16_dequant(
            qweight_t[:, n0:n1],
            scales_t[:, n0:n1],
            None if zeros_t is None else zeros_t[:, n0:n1],
            group_size,
            bits,
            scratch[: n1 - n0],
            k=k,
            config=config,
        )
        # cuBLAS writes the column slice in place (leading dimension N), no copy.
        torch.mm(x, w.t(), out=out[:, n0:n1])
    return out

"""Triton dequant-GEMM for W4A16 / W8A16: y[M, N] = x[M, K] @ dequant(W)[K, N].

The weight is `qweight_t` [K / f, N] int32 (f = 32 / bits codes per word, packed along K as in
compressed-tensors, transposed so that loads run along N). A K-tile never straddles a group
(BLOCK_K divides the group size), so the tile's codes (u - zero, exact in bf16/fp16) go through
`tl.dot` and the fp32 partial product is scaled once per output column. Small M uses split-K:
each program reduces a slice of K into an fp32 buffer [SPLIT_K, M, N] summed afterwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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


def default_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132) -> GemmConfig:
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    if config is None:
        num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 8
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

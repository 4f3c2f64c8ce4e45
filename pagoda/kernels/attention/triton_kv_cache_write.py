"""Triton kernel that scatters this step's K/V into the paged KV cache.

One program per token (times a tile of KV heads) copies the token's `[Hkv, D]` key and value
rows into slot `slot_mapping[t]` of `kv_cache [2, num_blocks, block_size, Hkv, D]`, in place.
Slots < 0 (padding tokens) are skipped. Torch reference: `paged_attention.write_kv_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.fp8.triton_e4m3 import f32_to_e4m3_bits, soft_e4m3_view


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_c_kv,  # K -> V plane
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_c_dim,
    num_kv_heads,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0: not an FP8 cache (plain cast)
):
    tok = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token (e.g. CUDA-graph batch padding): nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    # head_dim is padded to a power of two for tl.arange; the mask drops the padding lanes.
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]

    tok64 = tok.to(tl.int64)
    k = tl.load(
        key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    # int64 slot arithmetic: a large cache has more than 2^31 elements per plane.
    dst = (
        cache_ptr
        + block * stride_c_block
        + offset * stride_c_tok
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :] * stride_c_dim
    )
    if FP8_MAX > 0:  # FP8 cache: K / k_scale, V / v_scale, saturated to the format's range
        # div_rn: Triton's `/` on float32 is the approximate div.full.f32 (2 ulp), which lands
        # on the other side of an e4m3 rounding boundary now and then; torch divides exactly
        k = tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -FP8_MAX), FP8_MAX)
    if cache_ptr.dtype.element_ty == tl.uint8:  # e4m3 codes (no e4m3 conversion: sm_80 / 87)
        k = f32_to_e4m3_bits(k)
        v = f32_to_e4m3_bits(v)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T; -1 = padding, not written
    k_scale: float = 1.0,  # FP8 caches store K / k_scale, V / v_scale
    v_scale: float = 1.0,
    soft_e4m3: bool | None = None,  # e4m3 codes as uint8 (integer encode): None = below sm_89
) -> None:
    """Write K/V of the first `len(slot_mapping)` tokens into their cache slots, in place.

    `key`/`value` may be strided views (e.g. slices of a fused QKV output); the cache dtype may
    differ from the input dtype (values are cast on store).
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {key.shape} and {value.shape}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            f"kv_cache must be [2, N, bs, {key.shape[1]}, {key.shape[2]}], got {kv_cache.shape}"
        )
    num_tokens = slot_mapping.shape[0]
    if num_tokens > key.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} entries but key only {key.shape[0]} rows")
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    head_dim_pad = triton.next_power_of_2(head_dim)
    # Cover all KV heads of a token in one program when it fits (typical: 4-8 heads x 128);
    # 4096 elements per tensor keeps registers modest and the grid at T programs.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    fp8_max = torch.finfo(kv_cache.dtype).max if fp8 else 0.0
    kv_cache = soft_e4m3_view(kv_cache, soft_e4m3)
    _write_kv_cache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        num_kv_heads,
        float(k_scale) if fp8 else 1.0,
        float(v_scale) if fp8 else 1.0,
        BLOCK_SIZE=block_size,
        FP8_MAX=fp8_max,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_H=block_h,
        num_warps=4 if block_h * head_dim_pad >= 1024 else 1,
    )

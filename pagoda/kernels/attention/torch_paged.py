"""Paged attention in plain torch for CUDA without Triton (Jetson): CUDA-graph-safe decode and
memory-lean prefill.

The decode path reads no length on the host: it gathers each sequence's whole block-table row
into a padded [B, blocks * block_size] key / value view, masks by the device's `seq_lens` and
attends with SDPA, so a captured graph serves every length up to its table's width. The cache
write sends padding tokens (slot -1) to slot 0 of the null block with zeros, which keeps that
block zero without a data-dependent index. Prefill runs SDPA per sequence (flash / memory-
efficient kernels) instead of the reference's [H, Q, S] float32 scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.attention.reference import _gather_seq_kv, check_sliding_window


def write_kv_cache_static(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T; -1 = padding (writes zeros to slot 0)
) -> None:
    """`write_kv_cache_ref` without its boolean-mask index (a host sync): same cache after,
    as slot 0 (the null block's) holds zeros and only padding tokens write it."""
    num_tokens = slot_mapping.shape[0]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    k_flat = kv_cache[0].view(num_blocks * block_size, *kv_cache.shape[3:])  # [N*bs, Hkv, D]
    v_flat = kv_cache[1].view(num_blocks * block_size, *kv_cache.shape[3:])
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    valid = (slots >= 0)[:, None, None]  # [T', 1, 1]
    idx = slots.clamp(min=0)
    k_flat.index_copy_(0, idx, torch.where(valid, key[:num_tokens], 0).to(kv_cache.dtype))
    v_flat.index_copy_(0, idx, torch.where(valid, value[:num_tokens], 0).to(kv_cache.dtype))


def decode_attention_static(
    q: torch.Tensor,  # [B, H, D], one query per sequence (its last position)
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    seq_lens: torch.Tensor,  # [B] int (device), context length incl. this token
    block_tables: torch.Tensor,  # [B, max_blocks] int32; entries past a sequence: any valid id
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [B, H, D] in q's dtype
    """Decode attention with device-side lengths only (fixed shapes: capturable). Slots past a
    sequence are masked out but read: they must hold finite values (the runner zeroes the cache
    when this path serves, so stale blocks hold old K / V, never NaN)."""
    check_sliding_window(sliding_window)
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // kv_heads
    blocks = block_tables.to(device=kv_cache.device, dtype=torch.int64)  # [B, nb]
    span = blocks.shape[1] * block_size
    kv = kv_cache[:, blocks].view(2, num_seqs, span, kv_heads, head_dim)  # one gather
    pos = torch.arange(span, device=q.device)  # key positions [S]
    last = seq_lens.to(device=q.device, dtype=torch.int64).unsqueeze(1) - 1  # query [B, 1]
    visible = pos <= last  # [B, S]
    if sliding_window is not None:
        visible &= pos > last - sliding_window
    # GQA without copies: a KV head's `group` query heads (h // group, as the reference's
    # repeat_interleave) are SDPA's query rows, all at the same position (one mask row).
    out = F.scaled_dot_product_attention(
        q.contiguous().view(num_seqs, kv_heads, group, head_dim),  # [B, Hkv, G, D]
        kv[0].transpose(1, 2),  # [B, Hkv, S, D]
        kv[1].transpose(1, 2),
        attn_mask=visible[:, None, None, :],  # [B, 1, 1, S]
        scale=scale,
    )  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def decode_gather_bytes(num_seqs: int, span: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """Device bytes one `decode_attention_static` call holds for `num_seqs` sequences of `span`
    gathered positions: the gathered K and V, and the mask (as SDPA's float bias)."""
    return 2 * num_seqs * span * kv_heads * head_dim * elem + num_seqs * span * (1 + 4)


def prefill_attention_sdpa(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    query_start_loc_cpu: list[int],  # [B+1]
    seq_lens_cpu: list[int],  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor,  # [>=T, H, D]
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s result through SDPA per sequence (no [H, Q, S] float32 scores):
    causal by SDPA's own flag when the queries are the whole sequence and no window cuts, an
    explicit [Q, S] mask otherwise."""
    check_sliding_window(sliding_window)
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: query length {q_len} exceeds seq_len {seq_len}")
        q_offset = seq_len - q_len
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, q_offset - sliding_window + 1) // block_size
        k, v = _gather_seq_kv(kv_cache, block_tables[b], seq_len, first_block)  # [S, Hkv, D]
        if group > 1:  # not every fused SDPA backend takes GQA shapes
            k = k.repeat_interleave(group, dim=1)  # [S, H, D]
            v = v.repeat_interleave(group, dim=1)
        mask = None
        if q_offset or (sliding_window is not None and seq_len > sliding_window):
            q_pos = q_offset + torch.arange(q_len, device=q.device)
            k_pos = first_block * block_size + torch.arange(k.shape[0], device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [Q, S], True = visible
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        # 4-D [1, H, Q, D]: the flash / memory-efficient SDPA kernels take no other rank, and
        # the math fallback materializes [H, Q, S] scores (GiBs for one long prompt)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out

"""Torch reference kernels for the paged KV cache: cache write and paged attention.

These are the correctness oracles for the Triton kernels in `triton_*.py` and the CPU backend.
The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V);
token slot = `block_id * block_size + offset`. Attention is computed in float32 and returned in
the query dtype. An FP8 cache (float8_e4m3fn / float8_e5m2) stores K / scale_k and V / scale_v
(per-layer scales; clamped to the format's largest value) and is read back as stored * scale.
`sliding_window` W (None = full attention) follows transformers: key j is
visible from query i iff i - W < j <= i; keys of blocks wholly before the window are not read
(their block-table entries may be the null block). Only these references loop over sequences.
"""

from __future__ import annotations

import torch

from pagoda.kernels.norm_act.reference import apply_rotary_ref

# The fused decode attention with several new tokens per sequence (a speculative verify step)
# holds a tile row per (new token, query head of a KV head). Measured on an H100 (3B W4A16,
# context 512, graph replays; BENCHMARKS.md): it beats the paged attention up to 64 rows and 8
# sequences (k = 4: 1.31x a decode step against 1.47x at batch 1, 1.73x against 1.81x at 8)
# and loses past them (128-row tiles at k = 8: 2.35x against 1.70x; batch 32, k = 4: 2.05x
# against 1.95x). Beyond these the paged attention takes the step.
FUSED_MAX_QUERY_ROWS = 64
FUSED_MAX_VERIFY_SEQS = 16


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T; -1 = padding, not written
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write K/V of the first `len(slot_mapping)` tokens into their cache slots, in place."""
    num_tokens = slot_mapping.shape[0]
    key = key[:num_tokens]
    value = value[:num_tokens]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    # Flat views share storage with the cache, so index_copy_ writes through.
    k_flat = kv_cache[0].view(num_blocks * block_size, *kv_cache.shape[3:])  # [N*bs, Hkv, D]
    v_flat = kv_cache[1].view(num_blocks * block_size, *kv_cache.shape[3:])
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    valid = slots >= 0
    # Mask instead of branching on `valid.all()` so no host sync is needed.
    idx = slots[valid]
    k_new = to_cache_dtype(key[valid], kv_cache.dtype, k_scale)
    v_new = to_cache_dtype(value[valid], kv_cache.dtype, v_scale)
    if kv_cache.dtype in FP8_KV_DTYPES:  # index_copy_ has no FP8 kernels: copy the bytes
        k_flat, v_flat, k_new, v_new = (t.view(torch.uint8) for t in (k_flat, v_flat, k_new, v_new))
    k_flat.index_copy_(0, idx, k_new)
    v_flat.index_copy_(0, idx, v_new)


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: cast, or for FP8 x / scale clamped to the format's range."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def _gather_seq_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [first_block * block_size, seq_len) of one sequence: two [S, Hkv, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].to(device=kv_cache.device, dtype=torch.int64)
    num_keys = seq_len - first_block * block_size
    k = kv_cache[0, blocks].flatten(0, 1)[:num_keys]  # [S, Hkv, D]
    v = kv_cache[1, blocks].flatten(0, 1)[:num_keys]
    return k, v


def _attend(
    q: torch.Tensor,  # [Q, H, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, D]
    scale: float,
    q_offset: int,  # position of q[0]; q[i] sees keys at positions <= q_offset + i
    k_offset: int = 0,  # position of k[0]
    sliding_window: int | None = None,  # q[i] also sees only keys > its position - W
) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention in float32; returns [Q, H, D] float32."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, Q, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Q, S]
    q_pos = q_offset + torch.arange(q.shape[0], device=q.device)
    k_pos = k_offset + torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None, :] > q_pos[:, None]  # [Q, S], True = hidden
    if sliding_window is not None:
        mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)  # [Q, H, D]


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    query_start_loc_cpu: list[int],  # [B+1]
    seq_lens_cpu: list[int],  # [B], context length incl. this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [>=T, H, D]; rows past the last query are untouched
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 cache: stored values times these
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys (prefix + new)."""
    check_sliding_window(sliding_window)
    if out is None:
        out = torch.zeros_like(q)
    block_size = kv_cache.shape[2]
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: query length {q_len} exceeds seq_len {seq_len}")
        q_offset = seq_len - q_len
        # The first query sees keys from q_offset - W + 1 on: earlier blocks are never read.
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, q_offset - sliding_window + 1) // block_size
        k, v = _gather_seq_kv(kv_cache, block_tables[b], seq_len, first_block)
        if kv_cache.dtype in FP8_KV_DTYPES:
            k, v = k.float() * k_scale, v.float() * v_scale
        out[start:end] = _attend(
            q[start:end], k, v, scale, q_offset, first_block * block_size, sliding_window
        ).to(out.dtype)
    return out


def check_sliding_window(sliding_window: int | None) -> None:
    """ValueError unless `sliding_window` is None (full attention) or an int >= 1."""
    if sliding_window is None:
        return
    w = sliding_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def causal_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain causal attention over all tokens as one sequence (no cache): [T, H, D] in q.dtype."""
    return _attend(q, k, v, scale, 0, 0, sliding_window).to(q.dtype)


def fused_decode_attention_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H*D], un-rotated (left unmodified)
    k: torch.Tensor,  # [T, Hkv*D], un-rotated (left unmodified)
    v: torch.Tensor,  # [T, Hkv*D]
    cos_cache: torch.Tensor,  # [max_position, D/2] float32
    sin_cache: torch.Tensor,  # [max_position, D/2] float32
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D], updated in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding, not written
    query_start_loc_cpu: list[int],  # [B+1]
    seq_lens_cpu: list[int],  # [B], context length incl. this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_center: torch.Tensor | None = None,  # [Hkv, D]: subtracted from the rotated keys
) -> torch.Tensor:  # [T, H*D]
    """The unfused decode path op for op: neox RoPE on q/k, cache write, paged attention.

    Oracle of `triton_decode_attention.fused_decode_attention_triton`. Rows of padding tokens
    (slot -1) read whatever their sequence's last slot holds, so they are not comparable.
    """
    num_tokens = positions.shape[0]
    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q_rot = q.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)
    k_rot = k.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)
    apply_rotary_ref(positions, q_rot, k_rot, cos_cache, sin_cache, head_dim)
    k_new = k_rot.view(num_tokens, kv_heads, head_dim)
    if k_center is not None:
        k_new = k_new - k_center.to(k_new.dtype)
    write_kv_cache_ref(
        k_new,
        v.reshape(num_tokens, kv_heads, head_dim),
        kv_cache,
        slot_mapping,
        k_scale,
        v_scale,
    )
    out = paged_attention_ref(
        q_rot.view(num_tokens, -1, head_dim),
        kv_cache,
        query_start_loc_cpu,
        seq_lens_cpu,
        block_tables,
        scale,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return out.view(num_tokens, -1)

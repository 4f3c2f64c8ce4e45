"""Fused decode attention: RoPE + KV-cache write + paged GQA attention in one Triton launch.

For a decode-only batch (every sequence has exactly one new token, so token t is sequence t) the
unfused path runs the rotary kernel, the cache-write kernel, a `v.contiguous()` copy, the paged
attention kernel and (split-KV) the reduce: five dependent launches of ~1-6 us each at batch 1.
Here one program per (sequence, KV head, split) does all of it:

1. loads the new token's q heads of its GQA group, its k and v head straight from the strided
   QKV projection output (three views, any strides);
2. rotates q and k (neox / rotate-half, the cos/sin table row at `positions`), rounding every
   step to the model dtype exactly as `apply_rotary_ref` and the rotary kernel do, so the cached
   keys are bit-identical to the unfused path's;
3. split 0 stores the rotated k and v at `slot_mapping[t]` (slot < 0: padding, no store);
4. attends the group's query heads (padded to BLOCK_M >= 16 rows for tl.dot) to the cached
   keys [0, seq_len - 1) of its split through the block table (with a sliding window W only
   [seq_len - W, seq_len - 1): earlier blocks are never read), plus the new key itself, with
   the online softmax of `triton_paged_attention._attn_tile` (float32, exp2 domain);
5. writes the output [T, H*D] in the layout o_proj reads, or split partials that the
   `_split_kv_reduce_kernel` of the paged attention combines.

The new key never goes through memory within the launch: see the comment in the kernel. The
grid and every allocation depend only on shapes and host ints, so the call is CUDA-graph safe.

On sm_90 a program does two things before `gdc_wait` (while the QKV projection drains): every
program reads its key range (sequence length, block table), and the KV-head-0 program of each
(sequence, split) hands the copy engine the split's first KV_PF_BLOCKS cache blocks
(`cp.async.bulk.prefetch.L2`, all KV heads of a block at once), so the key loads after the wait
hit the L2 instead of waiting a DRAM round trip after the block table's (where those blocks of
the whole launch fit in a quarter of the L2). It changes no result.
Torch reference: `paged_attention.fused_decode_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda import platform
from pagoda.kernels.attention.reference import check_sliding_window
from pagoda.kernels.attention.triton_paged_attention import (
    _LOG2E,
    _attn_range,
    _launch_config,
    _num_sms,
    _split_kv_reduce_kernel,
    _split_range,
    choose_num_splits,
    effective_kv_len,
    fp16_dot_operand,
)
from pagoda.kernels.fp8.triton_e4m3 import e4m3_bits_to_f32, f32_to_e4m3_bits, soft_e4m3_view
from pagoda.kernels.norm_act.triton_fused_ops import _drop_bits, _round
from pagoda.kernels.pdl import pdl_launch_args

_KV_PF_BLOCKS = 4  # cache blocks a split prefetches before the wait (sm_90)
# query_len > 1: the most tile rows (new tokens x query heads of a KV head) it compiles for; the
# layer takes it only up to `FUSED_MAX_QUERY_ROWS`, where it measured faster (reference.py)
MAX_QUERY_ROWS = 128
KV_PF_BLOCKS = tl.constexpr(_KV_PF_BLOCKS)

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
    """One bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90+) by thread 0 of the program of
    `nbytes` (a multiple of 16) at `addr` (a 16-byte aligned pointer or int64 address). The
    thread goes on without waiting: the copy engine streams the bytes into the L2 while the
    kernel runs. Only a hint: results never change, only where later loads hit."""
    a = tl.zeros([1], dtype=tl.int64) + addr.to(tl.int64, bitcast=addr.dtype.is_ptr())
    size = tl.zeros([1], dtype=tl.int32) + nbytes
    tl.inline_asm_elementwise(
        _PREFETCH_ASM, "=r,l,r", [a, size], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _rotate_neox(x, x_partner, cos, sin, sign, DROP: tl.constexpr):
    """Rotate-half RoPE of full rows: x[d] pairs with x_partner[d] = x[(d + D/2) mod D].

    out[d] = x[d] cos - x[d + D/2] sin in the first half, x[d] cos + x[d - D/2] sin in the second
    (sign = -1 / +1). Each product and the sum are rounded to the model dtype like eager torch;
    RNE rounding is odd-symmetric, so sign * round(p) == round(sign * p) and the result matches
    `apply_rotary_ref` bit for bit.
    """
    return _round(_round(x * cos, DROP) + sign * _round(x_partner * sin, DROP), DROP)


@triton.jit
def _store_new_kv(
    k_rot, v_new, k_cache_ptr, v_cache_ptr, slot, split, kv_head, k_scale, v_scale,
    stride_cb, stride_ct, stride_ch, stride_cd, offs_d, d_mask, k_center_ptr,
    BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr, K_CENTER: tl.constexpr, DROP: tl.constexpr,
):  # fmt: skip
    """A new token's rotated key and value as the cache stores them (an FP8 cache: K / k_scale
    and V / v_scale, saturated; a uint8 one: their e4m3 codes); split 0 stores them at `slot`
    (< 0: padding, no store).
    Split 0 owns the new token: every split of the group holds the same values, one store is
    enough. A scalar branch rather than a mask: the interpreter turns `tensor & scalar` masks
    into int32, which tl.store rejects. Returns (k, v) as stored: the cache's dtype, float32
    values of the codes for a uint8 cache. K_CENTER (an FP8 cache only): the key minus the
    layer's constant `k_center_ptr` row of this KV head (`Attention.k_center`), rounded to the
    model dtype as the torch path's subtraction is."""
    if K_CENTER:
        k_rot = _round(k_rot - tl.load(k_center_ptr + offs_d, mask=d_mask, other=0.0), DROP)
    if FP8_MAX > 0:
        # exact division (`/` is div.full.f32 on the GPU): the codes torch's write gives
        k_st = tl.minimum(tl.maximum(tl.div_rn(k_rot, k_scale), -FP8_MAX), FP8_MAX)
        v_st = tl.minimum(tl.maximum(tl.div_rn(v_new.to(tl.float32), v_scale), -FP8_MAX), FP8_MAX)
        if k_cache_ptr.dtype.element_ty == tl.uint8:
            k_st = f32_to_e4m3_bits(k_st)
            v_st = f32_to_e4m3_bits(v_st)
        else:
            k_st = k_st.to(k_cache_ptr.dtype.element_ty)
            v_st = v_st.to(v_cache_ptr.dtype.element_ty)
    else:
        k_st = k_rot.to(k_cache_ptr.dtype.element_ty)
        v_st = v_new.to(v_cache_ptr.dtype.element_ty)
    if (split == 0) & (slot >= 0):
        c_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        c_off += kv_head * stride_ch + offs_d * stride_cd
        tl.store(k_cache_ptr + c_off, k_st, mask=d_mask)
        tl.store(v_cache_ptr + c_off, v_st, mask=d_mask)
    k_out = k_st
    v_out = v_st
    if k_cache_ptr.dtype.element_ty == tl.uint8:  # one return: Triton wants one type
        k_out = e4m3_bits_to_f32(k_st)
        v_out = e4m3_bits_to_f32(v_st)
    return k_out, v_out


@triton.jit
def _decode_prologue(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, tok, kv_head, split, qk_scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_cos, stride_sin,
    stride_cb, stride_ct, stride_ch, stride_cd,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, DROP: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr, FP8_MAX: tl.constexpr, k_center_ptr, K_CENTER: tl.constexpr,
):  # fmt: skip
    """One new token per sequence (`tok`): rotate its q heads of the group and its k, store k/v
    at its slot (split 0), and start the online softmax with the new key.
    Returns (acc, l, m, q_rot, head, row_valid, q_mask, tok per row)."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)

    half = HEAD_DIM // 2  # constexpr arithmetic
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    # Rotate-half on whole rows: lane d reads its pair partner too (an L1 hit), so q stays one
    # [BLOCK_M, D] tile for a single K = D dot per key tile.
    first_half = offs_d < half
    partner = tl.where(first_half, offs_d + half, offs_d - half)
    freq = tl.where(first_half, offs_d, offs_d - half)
    sign = tl.where(first_half, -1.0, 1.0)
    # The layer (like HF) casts the float32 table rows to the model dtype before multiplying.
    cos = tl.load(cos_ptr + pos * stride_cos + freq, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + freq, mask=d_mask, other=0.0).to(tl.float32)
    cos = _round(cos, DROP)
    sin = _round(sin, DROP)

    # Row m of the tile is query head kv_head * G + m; rows >= G are padding for tl.dot.
    offs_m = tl.arange(0, BLOCK_M)
    head = kv_head * NUM_QUERIES_PER_KV + offs_m
    row_valid = offs_m < NUM_QUERIES_PER_KV
    q_mask = row_valid[:, None] & d_mask[None, :]
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    q_x = tl.load(q_row + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    q_p = tl.load(q_row + partner[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    k_row = k_ptr + tok * stride_kt + kv_head * stride_kh
    k_x = tl.load(k_row + offs_d * stride_kd, mask=d_mask, other=0.0).to(tl.float32)
    k_p = tl.load(k_row + partner * stride_kd, mask=d_mask, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + tok * stride_vt + kv_head * stride_vh + offs_d * stride_vd,
                    mask=d_mask, other=0.0)  # fmt: skip
    if LAUNCH_DEPS:  # inputs read: the next kernel may launch (it still waits)
        tl.extra.cuda.gdc_launch_dependents()

    # Rotated values are exact in the model dtype (float32 here, so the casts below are exact).
    q_rot = _rotate_neox(q_x, q_p, cos[None, :], sin[None, :], sign[None, :], DROP)
    k_rot = _rotate_neox(k_x, k_p, cos, sin, sign, DROP)  # [HEAD_DIM_PAD]

    # Split 0 writes the token's K/V to the cache (`_store_new_kv`). An FP8 cache stores
    # K / k_scale and V / v_scale; the new key and value then take part in
    # this step as stored (what later steps read back), in stored units like the cached tiles:
    # k_scale is folded into qk_scale, v_scale into the output.
    k_st, v_st = _store_new_kv(
        k_rot, v_new, k_cache_ptr, v_cache_ptr, slot, split, kv_head, k_scale, v_scale,
        stride_cb, stride_ct, stride_ch, stride_cd, offs_d, d_mask, k_center_ptr,
        BLOCK_SIZE, FP8_MAX, K_CENTER, DROP,
    )  # fmt: skip
    k_use = k_st.to(tl.float32) if FP8_MAX > 0 else k_rot

    # Race freedom: nothing in this launch reads the new token's slot. Programs of one launch
    # are unordered (the other splits of this group may run before split 0 stores), and even
    # within split 0 the threads that store are not the ones that would load the tile back
    # without a barrier. So cache tiles cover only keys [0, ctx), and the key at position ctx is
    # folded in from registers by split 0 as the first key of its online softmax (score q . k,
    # weight 1, value v_new). Padding tokens (slot -1, seq_len 1) thus attend to their own k/v
    # alone: no cache access, a finite don't-care output. Split 0 always holds a key, as
    # `_split_kv_reduce_kernel` requires.
    first = (split == 0).to(tl.float32)
    s_new = tl.sum(q_rot * k_use[None, :], 1) * qk_scale  # [BLOCK_M], log2 domain
    m_i = tl.where(split == 0, s_new, float("-inf"))
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + first
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    acc += (v_st.to(tl.float32) * first)[None, :]

    tok_r = tl.zeros([BLOCK_M], dtype=tl.int64) + tok
    return acc, l_i, m_i, q_rot, head, row_valid, q_mask, tok_r


@triton.jit
def _new_key(
    k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, t,
    kv_head, split, k_scale, v_scale, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
    stride_vd, stride_cos, stride_sin, stride_cb, stride_ct, stride_ch, stride_cd,
    offs_d, d_mask, partner, freq, sign, k_center_ptr,
    BLOCK_SIZE: tl.constexpr, DROP: tl.constexpr, FP8_MAX: tl.constexpr, K_CENTER: tl.constexpr,
):  # fmt: skip
    """Token t's rotated key and value of `kv_head` as this step uses them (float32, in stored
    units for an FP8 cache); split 0 stores them at its slot (slot < 0: padding, no store)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    cos = _round(tl.load(cos_ptr + pos * stride_cos + freq, mask=d_mask, other=0.0), DROP)
    sin = _round(tl.load(sin_ptr + pos * stride_sin + freq, mask=d_mask, other=0.0), DROP)
    k_row = k_ptr + t * stride_kt + kv_head * stride_kh
    k_x = tl.load(k_row + offs_d * stride_kd, mask=d_mask, other=0.0).to(tl.float32)
    k_p = tl.load(k_row + partner * stride_kd, mask=d_mask, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + t * stride_vt + kv_head * stride_vh + offs_d * stride_vd,
                    mask=d_mask, other=0.0)  # fmt: skip
    k_rot = _rotate_neox(k_x, k_p, cos.to(tl.float32), sin.to(tl.float32), sign, DROP)
    k_st, v_st = _store_new_kv(
        k_rot, v_new, k_cache_ptr, v_cache_ptr, slot, split, kv_head, k_scale, v_scale,
        stride_cb, stride_ct, stride_ch, stride_cd, offs_d, d_mask, k_center_ptr,
        BLOCK_SIZE, FP8_MAX, K_CENTER, DROP,
    )  # fmt: skip
    return k_st.to(tl.float32), v_st.to(tl.float32)


@triton.jit
def _multi_query_prologue(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, tok, kv_head, split, qk_scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_cos, stride_sin,
    stride_cb, stride_ct, stride_ch, stride_cd,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, DROP: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr, FP8_MAX: tl.constexpr,
    QLEN: tl.constexpr, k_center_ptr, K_CENTER: tl.constexpr,
):  # fmt: skip
    """QLEN new tokens per sequence, tokens tok .. tok + QLEN - 1 at positions ctx .. ctx +
    QLEN - 1 (a speculative verify step: the last known token and k drafts). Row r of the tile
    is token j = r // G, query head kv_head * G + r % G (G = NUM_QUERIES_PER_KV). Each new key
    i is rotated, stored at its slot by split 0 and folded into split 0's online softmax from
    registers for the rows j >= i (causal), as the decode prologue does with its one key: the
    cache tiles then cover keys [0, ctx), which every row sees and nothing in the launch
    writes. Returns what `_decode_prologue` returns."""
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    first_half = offs_d < half
    partner = tl.where(first_half, offs_d + half, offs_d - half)
    freq = tl.where(first_half, offs_d, offs_d - half)
    sign = tl.where(first_half, -1.0, 1.0)

    offs_m = tl.arange(0, BLOCK_M)
    j = offs_m // NUM_QUERIES_PER_KV  # the row's token within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = offs_m < NUM_QUERIES_PER_KV * QLEN
    q_mask = row_valid[:, None] & d_mask[None, :]
    tok_r = tok + tl.where(row_valid, j, 0).to(tl.int64)
    pos = tl.load(pos_ptr + tok_r).to(tl.int64)  # [BLOCK_M]
    cos = tl.load(cos_ptr + pos[:, None] * stride_cos + freq[None, :], mask=q_mask, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * stride_sin + freq[None, :], mask=q_mask, other=0.0)
    cos = _round(cos.to(tl.float32), DROP)
    sin = _round(sin.to(tl.float32), DROP)
    q_row = q_ptr + tok_r[:, None] * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    q_x = tl.load(q_row + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    q_p = tl.load(q_row + partner[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    q_rot = _rotate_neox(q_x, q_p, cos, sin, sign[None, :], DROP)

    # split 0 folds the new keys in; other splits start empty (m = -inf, l = 0)
    is_split0 = (tl.zeros([BLOCK_M], dtype=tl.int32) + split) == 0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for i in tl.static_range(QLEN):
        k_use, v_use = _new_key(
            k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
            slot_mapping_ptr, tok + i, kv_head, split, k_scale, v_scale,
            stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_cos,
            stride_sin, stride_cb, stride_ct, stride_ch, stride_cd,
            offs_d, d_mask, partner, freq, sign, k_center_ptr, BLOCK_SIZE, DROP, FP8_MAX,
            K_CENTER,
        )  # fmt: skip
        s = tl.sum(q_rot * k_use[None, :], 1) * qk_scale  # [BLOCK_M], log2 domain
        s = tl.where((j >= i) & is_split0, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
        p = tl.exp2(s - m_ref)
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_use[None, :]
        m_i = m_new
    if LAUNCH_DEPS:  # inputs read: the next kernel may launch (it still waits)
        tl.extra.cuda.gdc_launch_dependents()
    return acc, l_i, m_i, q_rot, head, row_valid, q_mask, tok_r


# The block-table width changes per eager step: one compile for all (no mid-serving compile).
@triton.jit(do_not_specialize=["stride_bt"])
def _fused_decode_attention_kernel(
    q_ptr,  # [T, H, D] view (e.g. of the QKV output), not yet rotated
    k_ptr,  # [T, Hkv, D] view, not yet rotated
    v_ptr,  # [T, Hkv, D] view
    pos_ptr,  # [T] rotary positions
    cos_ptr,  # [max_position, D/2] float32
    sin_ptr,
    k_cache_ptr,  # [N, bs, Hkv, D] (plane 0 of the layer's cache)
    v_cache_ptr,  # [N, bs, Hkv, D] (plane 1)
    slot_mapping_ptr,  # [T] int64, -1 = padding
    seq_lens_ptr,  # [B = T] int32, including the new token
    block_tables_ptr,  # [B, max_blocks] int32
    out_ptr,  # [T, H, D] view of the [T, H*D] output
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32, only when NUM_SPLITS > 1
    part_m_ptr,  # [T, H, NUM_SPLITS] fp32
    part_l_ptr,  # [T, H, NUM_SPLITS] fp32
    k_center_ptr,  # [Hkv, D] float32 subtracted from every new key (K_CENTER only)
    qk_scale,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    k_scale,  # FP8 cache: K stored / k_scale (1.0 otherwise)
    v_scale,  # FP8 cache: V stored / v_scale (1.0 otherwise)
    window,  # sliding window W (only read with SLIDING)
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    DROP: tl.constexpr,  # `_round` bits of the model dtype
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (pagoda/kernels/pdl.py)
    PDL_EARLY: tl.constexpr = False,  # trigger the next launch first thing (pdl.py)
    KV_PF_BYTES: tl.constexpr = 0,  # bytes of one cache block (all KV heads) to prefetch; 0: off
    FP8_MAX: tl.constexpr = 0.0,  # an FP8 cache's largest value (0: the cache holds q's dtype)
    QLEN: tl.constexpr = 1,  # new tokens per sequence (1 + k in a speculative verify step)
    K_CENTER: tl.constexpr = False,  # an FP8 cache's key center (`Attention.k_center`)
):
    if USE_PDL and PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = seq.to(tl.int64) * QLEN  # the sequence's first new token (QLEN per sequence, in order)
    # Before the wait only what no kernel of this step writes: the step's inputs (lengths,
    # block table, copied in by the stream before the chain started), this layer's cache (only
    # this launch writes it, at the new token's slot, which it never reads back: a prefetched
    # block may hold that slot, harmlessly). (A pre-wait part may overlap any earlier kernel of
    # the chain still running, not just the previous one.)
    seq_len = tl.load(seq_lens_ptr + seq)
    # cached keys before this step's tokens, the first of which sits at position ctx (padding
    # sequences of a verify graph have seq_len = QLEN: no cached key)
    ctx = tl.maximum(seq_len - QLEN, 0)
    # The one query at position ctx sees cached keys [kv_start, ctx): with a window W those from
    # ctx - W + 1 on, so the range starts there and no key in it needs a window mask.
    if SLIDING:
        kv_start = tl.maximum(ctx + 1 - window, 0)
    else:
        kv_start = 0
    # (empty splits of a short sequence store m = -inf, l = 0)
    lo, hi = _split_range(kv_start, ctx, split, NUM_SPLITS, BLOCK_N)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if KV_PF_BYTES > 0:  # noqa: SIM102 (a constexpr: the block is pruned when 0)
        if kv_head == 0:  # the split's first cache blocks, every KV head, into the L2
            b_lo = lo // BLOCK_SIZE
            for b in range(b_lo, tl.minimum(tl.cdiv(hi, BLOCK_SIZE), b_lo + KV_PF_BLOCKS)):
                blk = tl.load(block_table_row + b).to(tl.int64)
                prefetch_l2(k_cache_ptr + blk * stride_cb, KV_PF_BYTES)
                prefetch_l2(v_cache_ptr + blk * stride_cb, KV_PF_BYTES)
    if USE_PDL:  # qkv comes from the projection still running: wait before reading it
        tl.extra.cuda.gdc_wait()
    if QLEN == 1:
        acc, l_i, m_i, q_rot, head, row_valid, q_mask, tok_r = _decode_prologue(
            q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
            slot_mapping_ptr, tok, kv_head, split, qk_scale, k_scale, v_scale,
            stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
            stride_vt, stride_vh, stride_vd, stride_cos, stride_sin,
            stride_cb, stride_ct, stride_ch, stride_cd,
            NUM_QUERIES_PER_KV, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, DROP,
            USE_PDL and not PDL_EARLY, FP8_MAX, k_center_ptr + kv_head * HEAD_DIM, K_CENTER,
        )  # fmt: skip
    else:
        acc, l_i, m_i, q_rot, head, row_valid, q_mask, tok_r = _multi_query_prologue(
            q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
            slot_mapping_ptr, tok, kv_head, split, qk_scale, k_scale, v_scale,
            stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
            stride_vt, stride_vh, stride_vd, stride_cos, stride_sin,
            stride_cb, stride_ct, stride_ch, stride_cd,
            NUM_QUERIES_PER_KV, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, DROP,
            USE_PDL and not PDL_EARLY, FP8_MAX, QLEN, k_center_ptr + kv_head * HEAD_DIM,
            K_CENTER,
        )  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    if UPCAST_DOT:  # the interpreter multiplies bf16 dot operands as raw bits: stay float32
        q = q_rot
    elif FP8_MAX > 0:  # an FP8 cache: fp16 tiles (`fp16_dot_operand`) for a bf16 model
        if q_ptr.dtype.element_ty == tl.bfloat16:
            q = fp16_dot_operand(q_rot)
        else:
            q = q_rot.to(q_ptr.dtype.element_ty)
    else:
        q = q_rot.to(q_ptr.dtype.element_ty)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    # Every row sees every cached key (all before ctx): the causal limit of `_attn_tile` is ctx.
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + ctx
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    acc, l_i, m_i = _attn_range(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, lo, lo, full_hi, hi, q_pos, q_pos,
        offs_d, d_mask, stride_cb, stride_ct, stride_cd, qk_scale,
        BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip

    if NUM_SPLITS == 1:
        o = acc * (v_scale / l_i[:, None])  # l_i >= 1: the top-scoring key has weight 1
        tl.store(
            out_ptr
            + tok_r[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # Unnormalised partials in the layout `_split_kv_reduce_kernel` reads.
        part = (tok_r * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc * v_scale,
            mask=row_valid[:, None],
        )
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)


# TRITON_INTERPRET=1 at import time turns the kernels into interpreted (CPU numpy) functions.
_INTERPRETED = not isinstance(_fused_decode_attention_kernel, triton.runtime.JITFunction)
# The reduce kernel is shared with `paged_attention_triton`; pass it the PDL flag if it has one.
_REDUCE_TAKES_PDL = {"USE_PDL", "PDL_EARLY"} <= set(_split_kv_reduce_kernel.arg_names)


def _heads_view(x: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> torch.Tensor:
    """x [T, heads*D] or [T, heads, D] as a [T, heads, D] view (never a copy)."""
    if x.shape[0] != num_tokens or x[0].numel() % head_dim != 0:
        raise ValueError(f"{name} must be [{num_tokens}, heads * {head_dim}], got {list(x.shape)}")
    try:
        return x.view(num_tokens, -1, head_dim)
    except RuntimeError as e:
        raise ValueError(f"{name} must be viewable as [T, heads, head_dim]: {e}") from e


def _kv_block_bytes(kv_cache: torch.Tensor, num_programs: int) -> int:
    """Bytes of one cache block (every KV head) where the kernel may bulk-prefetch blocks: a
    contiguous, 16-byte aligned cache on sm_90+, compiled, and at most a quarter of the L2 for
    KV_PF_BLOCKS K and V blocks of every (sequence, split) program (so what is fetched early is
    still there when read: batch-1 7B at 32 splits fetches 4 MiB); 0 elsewhere: no prefetch."""
    if _INTERPRETED or not kv_cache.is_cuda or not kv_cache.is_contiguous():
        return 0
    if platform.capability(kv_cache.device) < (9, 0) or kv_cache.data_ptr() % 16:
        return 0
    block = kv_cache.stride(1) * kv_cache.element_size()
    if (
        block % 16
        or num_programs * _KV_PF_BLOCKS * 2 * block > platform.l2_bytes(kv_cache.device) // 4
    ):
        return 0
    return block


def fused_decode_attention_triton(
    positions: torch.Tensor,  # [T] int, rotary positions of the new tokens
    q: torch.Tensor,  # [T, H*D] (or [T, H, D]), un-rotated; may be a strided view of qkv
    k: torch.Tensor,  # [T, Hkv*D], un-rotated
    v: torch.Tensor,  # [T, Hkv*D]
    cos_cache: torch.Tensor,  # [max_position, D/2] float32, as `RotaryEmbedding.cos_cache`
    sin_cache: torch.Tensor,  # [max_position, D/2]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D], same dtype as q; updated in place
    slot_mapping: torch.Tensor,  # [T] int64; -1 = padding token (not written, output don't-care)
    query_start_loc: torch.Tensor,  # [T+1] int32 (0, 1, ..., T): read by the split-KV reduce
    seq_lens: torch.Tensor,  # [T] int32, context length including the new token
    block_tables: torch.Tensor,  # [T, max_blocks] int32
    scale: float,
    max_seq_len: int,  # host int: tile / split choice only, not a bound on seq_lens
    num_splits: int | None = None,  # None = automatic (as paged attention); > 1 forces split-KV
    out: torch.Tensor | None = None,  # [T, H*D] with unit last stride
    sliding_window: int | None = None,  # None = full causal attention
    kv_prefetch: bool = True,  # sm_90: the splits' first cache blocks into the L2 pre-wait
    k_scale: float = 1.0,  # FP8 cache (float8_e4m3fn / e5m2): K stored / k_scale
    v_scale: float = 1.0,
    query_len: int = 1,  # new tokens per sequence: T = B * query_len (a verify step: 1 + k)
    soft_e4m3: bool | None = None,  # e4m3 codes as uint8 (integer decode): None = below sm_89
    k_center: torch.Tensor | None = None,  # [Hkv, D] float32, FP8 cache: K - k_center stored
) -> torch.Tensor:
    """RoPE on q/k, k/v into the paged cache, decode attention; returns out [T, H*D].

    Equivalent to `apply_rotary` + `write_kv_cache` + `paged_attention` on a batch whose
    sequence b owns tokens [b * query_len, (b + 1) * query_len), causal among themselves
    (query_len > 1: a speculative verify step; no sliding window, and at most
    `MAX_QUERY_ROWS` query rows of a GQA group). q, k and v are left unmodified (rotation
    happens in registers). One launch, plus `_split_kv_reduce_kernel` when num_splits > 1.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, N, bs, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = positions.shape[0]
    if positions.dim() != 1:
        raise ValueError(f"positions must be [T], got {list(positions.shape)}")
    q3 = _heads_view(q, "q", num_tokens, head_dim)
    k3 = _heads_view(k, "k", num_tokens, head_dim)
    v3 = _heads_view(v, "v", num_tokens, head_dim)
    num_heads = q3.shape[1]
    if k3.shape[1] != num_kv_heads or v3.shape[1] != num_kv_heads:
        raise ValueError(f"k and v must have {num_kv_heads} heads like kv_cache")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if query_len > 1 and num_heads // num_kv_heads * query_len > MAX_QUERY_ROWS:
        raise ValueError(
            f"query_len={query_len} x {num_heads // num_kv_heads} heads a KV head is over "
            f"{MAX_QUERY_ROWS} query rows: use the paged attention"
        )
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not fp8:
        k_scale = v_scale = 1.0  # scales describe FP8 storage only (as in the reference)
    if k_center is not None:
        if not fp8:
            raise ValueError("k_center applies to an FP8 cache only")
        if k_center.shape != (num_kv_heads, head_dim) or k_center.dtype != torch.float32:
            raise ValueError(
                f"k_center must be float32 [{num_kv_heads}, {head_dim}], got "
                f"{k_center.dtype} {list(k_center.shape)}"
            )
        k_center = k_center.contiguous()
    if not (q.dtype == k.dtype == v.dtype and (fp8 or kv_cache.dtype == q.dtype)):
        raise ValueError(
            f"q, k, v and kv_cache must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
            f"{kv_cache.dtype}"
        )
    if head_dim % 2 != 0 or cos_cache.dim() != 2 or 2 * cos_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos/sin caches must be [max_position, head_dim / 2 = {head_dim // 2}], got "
            f"{list(cos_cache.shape)}"
        )
    if sin_cache.shape != cos_cache.shape:
        raise ValueError(f"sin_cache {list(sin_cache.shape)} != cos_cache {list(cos_cache.shape)}")
    num_seqs = seq_lens.shape[0]
    if query_len < 1 or num_seqs * query_len != num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"need query_len={query_len} tokens per sequence, got T={num_tokens}, "
            f"B={num_seqs}, {slot_mapping.shape[0]} slots"
        )
    if block_tables.shape[0] < num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"block_tables must be [{num_seqs}, *], query_start_loc [B+1]")
    if query_len > 1 and sliding_window is not None:
        raise ValueError("query_len > 1 with a sliding window: use the paged attention")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    check_sliding_window(sliding_window)
    fp8_max = torch.finfo(kv_cache.dtype).max if fp8 else 0.0
    kv_cache = soft_e4m3_view(kv_cache, soft_e4m3)
    if out is None:
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (num_tokens, num_heads * head_dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {num_heads * head_dim}] with unit stride")
    if num_tokens == 0:
        return out
    out3 = out.view(num_tokens, num_heads, head_dim)
    cos_cache = cos_cache if cos_cache.stride(1) == 1 else cos_cache.contiguous()
    sin_cache = sin_cache if sin_cache.stride(1) == 1 else sin_cache.contiguous()

    kv_len = effective_kv_len(max_seq_len, 1, sliding_window)  # keys one program reads
    if num_splits is None:  # a program per (sequence, KV head) whatever query_len is
        num_splits = choose_num_splits(num_seqs, num_kv_heads, 1, kv_len, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    kv_pf_bytes = _kv_block_bytes(kv_cache, num_seqs * num_splits) if kv_prefetch else 0
    qpk = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    # a tile row per (new token, query head of the group)
    block_m, block_n, num_warps, num_stages = _launch_config(1, kv_len, qpk * query_len, num_splits)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # fp32 would silently use tf32 on tensor cores; keep it exact (fp32 is a test dtype only).
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast_dot = _INTERPRETED and q.dtype == torch.bfloat16

    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(part_acc.shape[:3], dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # never touched: NUM_SPLITS == 1 prunes those stores

    _fused_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q3, k3, v3, positions, cos_cache, sin_cache, k_cache, v_cache,
        slot_mapping, seq_lens, block_tables, out3, part_acc, part_m, part_l,
        k_center if k_center is not None else cos_cache,  # unread without K_CENTER
        scale * _LOG2E * k_scale, float(k_scale), float(v_scale), sliding_window or 0,
        num_heads,
        *q3.stride(), *k3.stride(), *v3.stride(), cos_cache.stride(0), sin_cache.stride(0),
        *k_cache.stride(), block_tables.stride(0), *out3.stride(),
        NUM_QUERIES_PER_KV=qpk, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        SLIDING=sliding_window is not None, DROP=_drop_bits(q.dtype),
        DOT_PRECISION=dot_precision, UPCAST_DOT=upcast_dot,
        KV_PF_BYTES=kv_pf_bytes, FP8_MAX=fp8_max,
        QLEN=query_len, K_CENTER=k_center is not None,
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch_args(q, early=True),
    )  # fmt: skip
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out3, part_acc, part_m, part_l, query_start_loc, num_seqs, num_heads,
            *out3.stride(),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim_pad >= 128 else 2,
            **(pdl_launch_args(q, early=True) if _REDUCE_TAKES_PDL else {}),
        )  # fmt: skip
    return out

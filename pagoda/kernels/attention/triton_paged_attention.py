"""Triton paged attention: any mix of prefill chunks and decodes in one launch, plus split-KV.

A program owns a tile of BLOCK_M query rows = (up to BLOCK_Q tokens of one sequence) x (the
query heads sharing one KV head), so each K/V tile is loaded once per GQA group. Keys are read
through the block table, scores use an online softmax in float32 (exp2 domain). Long decodes
with few programs split the key range (flash-decoding) and combine partials in a second kernel.
A sliding window W (transformers' rule: key j visible from query i iff i - W < j <= i) moves the
start of each program's key range up to its first query's window, so blocks before it are never
read (they may be the null block), and masks only the staggered edge tiles.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.reference import FP8_KV_DTYPES as _FP8_KV
from pagoda.kernels.attention.reference import check_sliding_window
from pagoda.kernels.fp8.triton_e4m3 import e4m3_bits_to_f16, soft_e4m3_view
from pagoda.kernels.pdl import pdl_launch_args

_LOG2E = 1.4426950408889634
# Split-KV tuning on an H200 (132 SMs, Qwen2.5-7B shapes, CUDA-graph timing): the best split
# count put about 2 programs per SM (B=1..16, context 1k..32k), and splits down to one 128-key
# tile still paid off (figures: BENCHMARKS.md, "Moved out").
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 128
_MAX_SPLITS = 64


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence b owns q-block indices [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1).

    Those ranges are disjoint, increasing in b and at least cdiv(q_len_b, BLOCK_Q) long, so a
    grid of T // BLOCK_Q + B programs covers every sequence without reading lengths on the host.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_tile(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    block_table_row,
    start_n,
    kv_limit,
    q_pos,
    win_lo,
    offs_d,
    d_mask,
    stride_kb,
    stride_kt,
    stride_kd,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One BLOCK_N tile of keys [start_n, start_n + BLOCK_N) folded into the running softmax.

    MASKED=False is the fast path for tiles every row of the program may fully see; MASKED=True
    applies the causal limit (q_pos), the key range end (kv_limit) and, with SLIDING, each row's
    window start (win_lo, [BLOCK_M]), and guards rows that have seen no key yet (m = -inf)
    against -inf - -inf.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    # Each key's cache block comes from the block table: BLOCK_N spans several blocks, and block
    # ids are arbitrary, so the address is gathered per key (rows of D stay contiguous).
    if MASKED:
        n_valid = offs_n < kv_limit
        blk = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blk = tl.load(block_table_row + offs_n // BLOCK_SIZE)
    kv_off = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt  # [BLOCK_N]
    k_ptrs = k_base + kv_off[None, :] + offs_d[:, None] * stride_kd  # [D_PAD, BLOCK_N]
    v_ptrs = v_base + kv_off[:, None] + offs_d[None, :] * stride_kd  # [BLOCK_N, D_PAD]
    if MASKED:
        k = tl.load(k_ptrs, mask=d_mask[:, None] & n_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    # An FP8 cache is read as q's type, fp16 for a bf16 model (`fp16_dot_operand`; its scales
    # are folded into qk_scale and the output); with UPCAST_DOT q is float32 already. A no-op
    # when the cache holds q's dtype. A uint8 cache holds e4m3 codes where Triton cannot
    # convert them (sm_80 / 87): decoded with 16-bit integer operations (exact).
    if k_base.dtype.element_ty == tl.uint8:
        k = e4m3_bits_to_f16(k)
        v = e4m3_bits_to_f16(v)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] log2 domain
    if MASKED:
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] >= win_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    m_ref = m_new
    if MASKED:
        # A row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0
        # rather than NaN (-inf - -inf), while m itself stays -inf for later tiles / the reduce.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def fp16_dot_operand(q):
    """q (bf16 / float32 values) as the fp16 operand of the dots against an FP8 cache's tiles.

    Every e4m3 / e5m2 value is an fp16 value, and fp16 is what the GPU converts FP8 to in one
    instruction (two values a `cvt`; bf16 takes three more through float32): so against an FP8
    cache both dots run in fp16 — q . k and p . v, with the probabilities in fp16's 11 bits
    rather than bf16's 8. A bf16 q is exact in fp16 within +-65,504 (clamped there; beyond it a
    score saturates the softmax either way) down to 2^-14 (smaller entries keep fewer bits:
    below 2^-14 of a term they cannot move a score)."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _split_range(kv_start, kv_end, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split `split` of [kv_start, kv_end): chunks sized per sequence (a
    multiple of BLOCK_N) so shorter sequences of a batch split evenly too; trailing splits of a
    short sequence are empty (lo >= hi)."""
    if NUM_SPLITS == 1:
        lo = kv_start
        hi = kv_end
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    return lo, hi


@triton.jit
def _attn_range(
    acc, l_i, m_i, q, k_base, v_base, block_table_row, lo, head_hi, full_hi, hi, q_pos, win_lo,
    offs_d, d_mask, stride_kb, stride_kt, stride_kd, qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Keys [lo, hi) in BLOCK_N tiles: with SLIDING, masked tiles up to head_hi (the staggered
    window starts of the rows), then unmasked tiles up to full_hi, then the masked tail (the
    diagonal / range end). Shared by the paged and the fused decode kernels."""
    if SLIDING:
        for start_n in range(lo, head_hi, BLOCK_N):
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, k_base, v_base, block_table_row, start_n, hi, q_pos, win_lo,
                offs_d, d_mask, stride_kb, stride_kt, stride_kd, qk_scale,
                BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
    for start_n in range(head_hi, full_hi, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, block_table_row, start_n, hi, q_pos, win_lo,
            offs_d, d_mask, stride_kb, stride_kt, stride_kd, qk_scale,
            BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, block_table_row, start_n, hi, q_pos, win_lo,
            offs_d, d_mask, stride_kb, stride_kt, stride_kd, qk_scale,
            BLOCK_SIZE, BLOCK_N, True, SLIDING, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    return acc, l_i, m_i


# The sequence count and block-table width change every eager step: specialized on them
# (== 1, % 16) the kernel would be compiled again mid-serving, stalling every running request.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32, only when NUM_SPLITS > 1
    part_m_ptr,  # [T, H, NUM_SPLITS] fp32
    part_l_ptr,  # [T, H, NUM_SPLITS] fp32
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    v_scale,  # FP8 cache: V is stored / v_scale (1.0 otherwise)
    window,  # sliding window W (only read with SLIDING)
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_Q_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if SINGLE_Q_BLOCK:  # every sequence's queries fit one tile (decode): program = sequence
        seq = pid_q
        q_block = 0
    else:
        seq = _find_seq_idx(query_start_loc_ptr, pid_q, num_seqs, BLOCK_Q)
        q_block = pid_q - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # spare program of the over-provisioned grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached prefix before this step's queries

    # Row m of the tile is query token m // G of this block and head m % G of the KV group:
    # packing tokens x heads fills the MMA's M dimension even for decode (G rows used).
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # query index within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position = causal limit of the row
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    elif (q_ptr.dtype.element_ty == tl.bfloat16) and (k_cache_ptr.dtype.element_ty != tl.bfloat16):
        q = fp16_dot_operand(q)  # an FP8 cache: fp16 tiles

    # Keys [0, kv_end) are visible to the last query of the tile; [0, kv_full) to all of them.
    # With a window, [kv_start, kv_end) to some row and [win_full, kv_full) to all of them.
    q_last = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_len + q_last + 1
    kv_full = context_len + q_block * BLOCK_Q + 1
    if SLIDING:
        win_lo = q_pos - window + 1  # [BLOCK_M] first visible key of each row
        kv_start = tl.maximum(kv_full - window, 0)  # the first query's window start
        win_full = kv_end - window  # every row sees keys from here on
    else:
        win_lo = q_pos  # unused
        kv_start = 0
        win_full = 0
    lo, hi = _split_range(kv_start, kv_end, split, NUM_SPLITS, BLOCK_N)
    head_hi = lo
    if SLIDING:  # tiles starting before win_full are masked per row
        head_hi = lo + tl.cdiv(tl.maximum(win_full - lo, 0), BLOCK_N) * BLOCK_N
    full_hi = head_hi + tl.maximum(tl.minimum(hi, kv_full) - head_hi, 0) // BLOCK_N * BLOCK_N

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # Unmasked tiles first; only the diagonal / range-end tiles pay for masking. Tiles past the
    # causal limit of the block's last query are never visited.
    acc, l_i, m_i = _attn_range(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, lo, head_hi, full_hi, hi, q_pos,
        win_lo, offs_d, d_mask, stride_kb, stride_kt, stride_kd, qk_scale,
        BLOCK_SIZE, BLOCK_N, SLIDING, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip

    if NUM_SPLITS == 1:
        # Every valid row saw its own key, so l_i > 0 there.
        o = acc * (v_scale / l_i[:, None])
        tl.store(
            out_ptr
            + tok[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        # Unnormalised partials; an empty split (or one wholly outside a row's window) stores
        # m = -inf, l = 0, acc = 0.
        part = (tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc * v_scale,
            mask=row_valid[:, None],
        )
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_seqs"])
def _split_kv_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (pagoda/kernels/pdl.py)
    PDL_EARLY: tl.constexpr = False,  # trigger the next launch first thing (pdl.py)
):
    if USE_PDL and PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    # Rows past the last query (batch padding) have no partials and must stay untouched.
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    sumexp = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    m_max = tl.max(m, 0)  # finite: some split holds the row's own key
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(sumexp * w, 0)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# TRITON_INTERPRET=1 at import time turns the kernels into interpreted (CPU numpy) functions.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # CPU / interpreter: auto mode never splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
) -> int:
    """Split-KV factor for a batch: > 1 only for decode-only batches that underfill the GPU.

    Depends on max_seq_len, so a CUDA-graph capture that must replay for any length should pass
    a fixed `num_splits` instead (chunks are sized per sequence at run time, so any fixed value
    is correct).
    """
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(
        math.ceil(_PROGRAMS_PER_SM * num_sms / programs),
        max_seq_len // _MIN_KEYS_PER_SPLIT,
        _MAX_SPLITS,
    )
    return splits if splits >= 2 else 1


def _launch_config(
    max_query_len: int, max_seq_len: int, num_queries_per_kv: int, num_splits: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the main kernel, tuned on an H200."""
    if max_query_len * num_queries_per_kv <= 16 or max_query_len == 1:
        # Decode: M is just the GQA group (tl.dot needs M >= 16); memory bound. 128-key tiles
        # with 3 stages keep more bytes in flight per program, which wins when a program reads
        # many keys; on short contexts the lighter 64-key tile wins (BENCHMARKS.md, "Tuning
        # figures moved out of the code").
        block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
        if max_seq_len >= 4096 or num_splits > 1:
            return block_m, 128, 4, 3
        return block_m, 64, 4, 2
    # Prefill / mixed: 64 x 64 tiles with 4 warps beat 128 x 64 with 8 warps on 8k causal
    # prefill (BENCHMARKS.md, same section) and waste fewer rows on decodes mixed in.
    return max(64, triton.next_power_of_2(num_queries_per_kv)), 64, 4, 2


def effective_kv_len(max_seq_len: int, max_query_len: int, sliding_window: int | None) -> int:
    """The most keys one program of a query tile reads: the window bounds it (+ the tile's span)."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + max_query_len - 1)


def kernel_variant(
    max_query_len: int, kv_len: int, num_queries_per_kv: int, num_splits: int
) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, SINGLE_Q_BLOCK): what a launch compiles for,
    besides the model's fixed shapes (`kv_len`: the keys a program reads, `effective_kv_len`)."""
    block_m, block_n, num_warps, num_stages = _launch_config(
        max_query_len, kv_len, num_queries_per_kv, num_splits
    )
    return block_m, block_n, num_warps, num_stages, max_query_len <= block_m // num_queries_per_kv


def mixed_step_variants(
    num_queries_per_kv: int, max_model_len: int, sliding_window: int | None = None
) -> list[tuple[int, int]]:
    """One (max_query_len, max_seq_len) per kernel variant that an eager step whose longest
    query has 2 or more tokens can compile: the tiles of `_launch_config` and SINGLE_Q_BLOCK
    (split-KV is only chosen for decode-only steps). Beyond the first prefill's variant these
    come from mixed steps that are rare but certain under load: chunked prefill leaves a
    prompt's tail of a few tokens beside the running decodes, and its step takes the decode
    tiles (2 tokens) or one query block per sequence (up to BLOCK_Q tokens)."""
    seen: dict[tuple, tuple[int, int]] = {}
    for q in range(2, min(max_model_len, 130) + 1):
        # the shortest context, and one at the decode tiles' 4096-key threshold
        for kv in sorted({q, min(max_model_len, max(q, 4096))}):
            eff = effective_kv_len(kv, q, sliding_window)
            seen.setdefault(kernel_variant(q, eff, num_queries_per_kv, 1), (q, kv))
    return list(seen.values())


def warm_up_mixed_steps(
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D], a layer's cache (its null block 0 is read)
    num_heads: int,
    scale: float,
    max_model_len: int,
    sliding_window: int | None = None,
    q_dtype: torch.dtype | None = None,  # the model's dtype (None: the cache's)
) -> int:
    """Compile every `mixed_step_variants` kernel now, on one dummy sequence over the null
    block, so that no step compiles one while requests wait; returns the launches made."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    dev = kv_cache.device
    variants = mixed_step_variants(num_heads // num_kv_heads, max_model_len, sliding_window)
    for q_len, kv_len in variants:
        q = torch.zeros((q_len, num_heads, head_dim), dtype=q_dtype or kv_cache.dtype, device=dev)
        table = torch.zeros((1, -(-kv_len // block_size)), dtype=torch.int32, device=dev)
        paged_attention_triton(
            q,
            kv_cache,
            torch.tensor([0, q_len], dtype=torch.int32, device=dev),
            torch.tensor([kv_len], dtype=torch.int32, device=dev),
            table,
            scale,
            q_len,
            kv_len,
            sliding_window=sliding_window,
        )
    return len(variants)


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length incl. this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [>=T, H, D]; rows past the last query are untouched
    num_splits: int | None = None,  # None = automatic; 1 = never split; > 1 forces split-KV
    sliding_window: int | None = None,  # None = full causal attention
    k_scale: float = 1.0,  # FP8 cache (float8_e4m3fn / e5m2): K = stored * k_scale
    v_scale: float = 1.0,
    soft_e4m3: bool | None = None,  # e4m3 codes as uint8 (integer decode): None = below sm_89
) -> torch.Tensor:
    """Causal paged attention for a batch mixing prefill chunks (with cached prefix) and decodes.

    An FP8 cache's tiles are converted to q's dtype as they are loaded; k_scale folds into the
    softmax scale and v_scale into the output, so the inner loop does no extra multiply.

    Query i of sequence b sits at position `seq_lens[b] - q_len_b + i` and sees keys at positions
    <= its own (and > its own - sliding_window). The launch grid depends only on shapes and the
    host ints `max_query_len` / `max_seq_len` (no device-to-host sync), so the call can be
    captured in a CUDA graph.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, N, bs, Hkv, D], got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if kv_cache.dtype != q.dtype and kv_cache.dtype not in _FP8_KV:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")
    if kv_cache.dtype not in _FP8_KV:
        k_scale = v_scale = 1.0  # scales describe FP8 storage only (as in the reference)
    kv_cache = soft_e4m3_view(kv_cache, soft_e4m3)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"query_start_loc must be [B+1] and block_tables [B, max_blocks] for B={num_seqs}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    check_sliding_window(sliding_window)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    # Tiles and splits follow the keys a program reads, which the window caps.
    kv_len = effective_kv_len(max_seq_len, max_query_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_query_len, kv_len, _num_sms(q.device)
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    qpk = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages, single_q_block = kernel_variant(
        max_query_len, kv_len, qpk, num_splits
    )
    block_q = block_m // qpk
    grid_q = num_seqs if single_q_block else num_tokens // block_q + num_seqs

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # fp32 would silently use tf32 on tensor cores; keep it exact (fp32 is a test dtype only).
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The Triton interpreter (3.6-3.9) multiplies bf16 dot operands as raw uint16 bits.
    upcast_dot = _INTERPRETED and q.dtype == torch.bfloat16

    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(part_acc.shape[:3], dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # never touched: NUM_SPLITS == 1 prunes those stores

    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E * k_scale,
        float(v_scale),
        sliding_window or 0,
        num_seqs,
        num_heads,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=qpk,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SINGLE_Q_BLOCK=single_q_block,
        NUM_SPLITS=num_splits,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast_dot,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            query_start_loc,
            num_seqs,
            num_heads,
            *out.stride(),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim_pad >= 128 else 2,
            **pdl_launch_args(q),
        )
    return out

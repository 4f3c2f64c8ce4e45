"""The torch reference kernels of the paged KV cache against naive dense attention.

The dense oracle loops over every query and key in float64, independent of block tables, so a
bug in slot arithmetic, GQA head mapping or the causal offset shows up as a mismatch.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagoda.kernels.attention.reference import (
    causal_attention_ref,
    paged_attention_ref,
    write_kv_cache_ref,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 32
H, HKV, D = 4, 2, 8


def _dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    offset: int,
    window: int | None = None,
) -> torch.Tensor:
    """q [Q, H, D], k/v [S, Hkv, D]; query i sees keys 0..offset+i, or with a window W only
    those j with offset+i - W < j (transformers' rule). Float64 loops."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = offset + i + 1
        first = 0 if window is None else max(0, offset + i - window + 1)
        for h in range(q.shape[1]):
            kh = k[first:visible, h // group].double()  # [visible - first, D]
            vh = v[first:visible, h // group].double()
            probs = torch.softmax(kh @ q[i, h].double() * scale, dim=0)
            out[i, h] = probs @ vh
    return out


def _allocate(seq_lens: list[int], rng: random.Random) -> list[list[int]]:
    """Shuffled, non-contiguous block ids (never block 0, the null block)."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    tables = []
    for seq_len in seq_lens:
        n = math.ceil(seq_len / BLOCK_SIZE)
        tables.append([free.pop() for _ in range(n)])
    return tables


def _slots(block_ids: list[int], positions: range) -> list[int]:
    return [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_write_kv_cache_skips_padding_and_extra_tokens() -> None:
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    key, value = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    # 4 slots for 5 tokens: the fifth token is beyond the mapping and must not be written.
    slot_mapping = torch.tensor([9, -1, 4, 30], dtype=torch.int64)
    write_kv_cache_ref(key, value, kv_cache, slot_mapping)
    flat_k = kv_cache[0].view(-1, HKV, D)
    flat_v = kv_cache[1].view(-1, HKV, D)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], key[t])
            torch.testing.assert_close(flat_v[slot], value[t])
    written = {9, 4, 30}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(dtype: torch.dtype) -> None:
    """A batch mixing a cached prefix + chunk, a decode and a fresh prefill."""
    rng = random.Random(0)
    torch.manual_seed(0)
    seq_lens = [11, 6, 5]  # context after this step
    q_lens = [3, 1, 5]  # chunk of 3 after 8 cached; decode after 5; full prefill
    tables = _allocate(seq_lens, rng)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=dtype)
    keys = [torch.randn(n, HKV, D).to(dtype) for n in seq_lens]
    values = [torch.randn(n, HKV, D).to(dtype) for n in seq_lens]
    for b, seq_len in enumerate(seq_lens):
        slots = torch.tensor(_slots(tables[b], range(seq_len)), dtype=torch.int64)
        write_kv_cache_ref(keys[b], values[b], kv_cache, slots)

    query_start_loc = [0]
    for q_len in q_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    q = torch.randn(query_start_loc[-1], H, D).to(dtype)
    max_blocks = max(len(t) for t in tables) + 1  # one column of null-block padding
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, table in enumerate(tables):
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
    scale = D**-0.5

    out = paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        expected = _dense_attention(q[start:end], keys[b], values[b], scale, seq_len - q_len)
        torch.testing.assert_close(out[start:end].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9, 40])
def test_paged_attention_sliding_window_matches_dense(window: int) -> None:
    """Windows smaller than, equal to, not a multiple of and larger than the block size (4), on
    a cached prefix + chunk, a decode and a fresh prefill. Blocks wholly before the first
    query's window are the null block in the table and NaN in the cache: never read."""
    rng = random.Random(window)
    torch.manual_seed(window)
    seq_lens = [23, 14, 9]
    q_lens = [5, 1, 9]
    tables = _allocate(seq_lens, rng)
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, HKV, D), float("nan"))
    keys = [torch.randn(n, HKV, D) for n in seq_lens]
    values = [torch.randn(n, HKV, D) for n in seq_lens]
    block_tables = torch.zeros(len(seq_lens), max(len(t) for t in tables), dtype=torch.int32)
    query_start_loc = [0]
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        slots = torch.tensor(_slots(tables[b], range(seq_len)), dtype=torch.int64)
        write_kv_cache_ref(keys[b], values[b], kv_cache, slots)
        dropped = max(0, seq_len - q_len - window + 1) // BLOCK_SIZE
        for i, block in enumerate(tables[b]):
            if i < dropped:
                kv_cache[:, block] = float("nan")  # freed: whatever it holds is not ours
            else:
                block_tables[b, i] = block
        query_start_loc.append(query_start_loc[-1] + q_len)
    q = torch.randn(query_start_loc[-1], H, D)
    scale = D**-0.5
    out = paged_attention_ref(
        q, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window=window
    )
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        expected = _dense_attention(
            q[start:end], keys[b], values[b], scale, seq_len - q_len, window
        )
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-5, rtol=1e-5)
    # No window: the same as full attention (and different from a window that cuts keys off).
    full = paged_attention_ref(q, kv_cache.nan_to_num(), query_start_loc, seq_lens,
                               block_tables, scale, sliding_window=None)  # fmt: skip
    assert window >= 23 or not torch.allclose(full, out)


def test_causal_attention_ref_sliding_window() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(11, H, D), torch.randn(11, HKV, D), torch.randn(11, HKV, D)
    out = causal_attention_ref(q, k, v, 0.25, sliding_window=3)
    torch.testing.assert_close(
        out.double(), _dense_attention(q, k, v, 0.25, 0, window=3), atol=1e-5, rtol=1e-5
    )


def test_bad_sliding_window() -> None:
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, HKV, D)
    q = torch.zeros(1, H, D)
    table = torch.ones(1, 1, dtype=torch.int32)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            paged_attention_ref(q, kv_cache, [0, 1], [1], table, 1.0, sliding_window=bad)


def test_paged_attention_out_leaves_padding_rows() -> None:
    torch.manual_seed(0)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    q = torch.randn(3, H, D)
    out = torch.full((5, H, D), 7.0)  # 3 real rows + 2 padding rows
    block_tables = torch.tensor([[3, 5]], dtype=torch.int32)
    result = paged_attention_ref(q, kv_cache, [0, 3], [6], block_tables, 0.3, out=out[:3])
    assert result.data_ptr() == out.data_ptr()
    assert torch.all(out[3:] == 7.0)
    assert not torch.any(out[:3] == 7.0)


def test_causal_attention_ref_matches_dense() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(7, H, D), torch.randn(7, HKV, D), torch.randn(7, HKV, D)
    out = causal_attention_ref(q, k, v, 0.25)
    torch.testing.assert_close(
        out.double(), _dense_attention(q, k, v, 0.25, 0), atol=1e-5, rtol=1e-5
    )


def test_paged_attention_rejects_bad_heads() -> None:
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 3, D)
    q = torch.zeros(1, 4, D)  # 4 heads over 3 kv heads
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_ref(q, kv_cache, [0, 1], [1], torch.ones(1, 1, dtype=torch.int32), 1.0)

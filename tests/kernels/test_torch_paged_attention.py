"""The torch attention paths of CUDA without Triton (`torch_paged.py`) against the references
on the CPU: the graph-safe decode (padded block tables, stale blocks past the lengths,
padding rows, GQA, sliding windows), its cache write, and the SDPA prefill; on the GPU, one
captured graph replayed at other lengths."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.attention.reference import paged_attention_ref, write_kv_cache_ref
from pagoda.kernels.attention.torch_paged import (
    decode_attention_static,
    decode_gather_bytes,
    prefill_attention_sdpa,
    write_kv_cache_static,
)

BS = 16  # block size


def _cache(num_blocks, kv_heads, head_dim, seed, device="cpu"):
    """Random K / V, the null block 0 zero, the last four blocks large (stale data of another
    sequence: never in one here, they would dominate the softmax if read unmasked)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, BS, kv_heads, head_dim, generator=g).to(device)
    cache[:, 0] = 0
    cache[:, -4:] = 50.0
    return cache


def _tables(seq_lens, width, num_blocks, seed):
    """Each sequence's blocks (distinct, shuffled, from 1 .. num_blocks - 5); past its length
    the row holds stale ids of the large blocks."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 5, generator=g) + 1).tolist()
    table = torch.randint(num_blocks - 4, num_blocks, (len(seq_lens), width), generator=g)
    for b, n in enumerate(seq_lens):
        need = -(-n // BS)
        table[b, :need] = torch.tensor([free.pop() for _ in range(need)])
    return table.to(torch.int32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_the_reference(heads, kv_heads, window) -> None:
    head_dim, num_blocks = 32, 64
    seq_lens = [1, 5, 16, 17, 40, 100]
    cache = _cache(num_blocks, kv_heads, head_dim, seed=1)
    table = _tables(seq_lens, width=10, num_blocks=num_blocks, seed=2)  # 160 positions a row
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    scale = head_dim**-0.5
    ref = paged_attention_ref(
        q, cache, list(range(len(seq_lens) + 1)), seq_lens, table, scale, sliding_window=window
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = decode_attention_static(q, cache, lens, table, scale, window)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # bf16 queries and cache: the result in bf16, computed in float32 like the reference
    out16 = decode_attention_static(q.bfloat16(), cache.bfloat16(), lens, table, scale, window)
    assert out16.isfinite().all()
    ref16 = paged_attention_ref(
        q.bfloat16(), cache.bfloat16(), list(range(len(seq_lens) + 1)), seq_lens, table, scale,
        sliding_window=window,
    )  # fmt: skip
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref16.float(), rtol=0, atol=2**-7)


def test_padding_rows_read_the_null_block() -> None:
    """CUDA-graph padding rows (seq_len 1, table all 0) give zeros and no NaN."""
    cache = _cache(16, 2, 8, seed=4)
    q = torch.randn(3, 4, 8)
    table = torch.zeros(3, 5, dtype=torch.int32)
    out = decode_attention_static(q, cache, torch.ones(3, dtype=torch.int32), table, 0.3)
    assert torch.equal(out, torch.zeros_like(out))


def test_cache_write_matches_the_reference() -> None:
    """Padding tokens (slot -1) leave the cache as the reference leaves it: the null block's
    slot 0 stays zero."""
    kv_heads, head_dim = 2, 8
    base = torch.randn(2, 8, BS, kv_heads, head_dim)
    base[:, 0] = 0
    k, v = torch.randn(5, kv_heads, head_dim), torch.randn(5, kv_heads, head_dim)
    slots = torch.tensor([17, -1, 40, -1, 127])
    ref, got = base.clone(), base.clone()
    write_kv_cache_ref(k, v, ref, slots)
    write_kv_cache_static(k, v, got, slots)
    assert torch.equal(got, ref) and not torch.equal(got, base)
    write_kv_cache_static(k.bfloat16(), v.bfloat16(), got, slots[:3])  # T' < T, another dtype
    assert torch.equal(got[0].view(-1, kv_heads, head_dim)[40], k[2].bfloat16().float())


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_matches_the_reference(heads, kv_heads, window) -> None:
    """Whole prompts (SDPA's causal flag) and chunks after a cached prefix (explicit mask),
    mixed with decodes, with and without a window."""
    head_dim, num_blocks = 32, 64
    seq_lens = [30, 50, 9, 70]
    q_lens = [30, 12, 1, 33]  # whole, chunk, decode, chunk
    loc = [0]
    for n in q_lens:
        loc.append(loc[-1] + n)
    cache = _cache(num_blocks, kv_heads, head_dim, seed=5)
    table = _tables(seq_lens, width=6, num_blocks=num_blocks, seed=6)
    q = torch.randn(loc[-1], heads, head_dim, generator=torch.Generator().manual_seed(7))
    ref = paged_attention_ref(q, cache, loc, seq_lens, table, 0.2, sliding_window=window)
    out = prefill_attention_sdpa(
        q, cache, loc, seq_lens, table, 0.2, torch.zeros_like(q), sliding_window=window
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_gather_bytes() -> None:
    # K and V: 2 x 4096 x 2 x 128 x 2 bytes a sequence; the mask: bool and float32
    assert decode_gather_bytes(3, 4096, 2, 128, 2) == 3 * (2 * 4096 * 256 * 2 + 4096 * 5)


@pytest.mark.gpu
def test_decode_graph_replays_at_other_lengths_gpu() -> None:
    """One captured write + decode serves other lengths and tables copied in before replay."""
    kv_heads, heads, head_dim, num_blocks, width = 2, 8, 64, 64, 10
    cache = _cache(num_blocks, kv_heads, head_dim, seed=8, device="cuda").bfloat16()
    lens = torch.ones(4, dtype=torch.int32, device="cuda")
    table = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    slots = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    q = torch.zeros(4, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(4, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)

    def step():
        write_kv_cache_static(k, v, cache, slots)
        return decode_attention_static(q, cache, lens, table, 0.125)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(9)
    for seq_lens in ([3, 17, 100, 1], [160, 1, 33, 64]):
        new_table = _tables(seq_lens, width, num_blocks, seed=seq_lens[0])
        new_slots = torch.tensor(
            [int(new_table[b, (n - 1) // BS]) * BS + (n - 1) % BS for b, n in enumerate(seq_lens)]
        )
        new_slots[-1] = -1  # a padding row
        q.copy_(torch.randn(q.shape, generator=g))
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        lens.copy_(torch.tensor(seq_lens))
        table.copy_(new_table)
        slots.copy_(new_slots)
        expect_cache = cache.clone()
        write_kv_cache_ref(k, v, expect_cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, expect_cache)
        ref = paged_attention_ref(
            q.float().cpu(), cache.float().cpu(), [0, 1, 2, 3, 4], seq_lens, new_table, 0.125
        )
        # bf16 SDPA rounds the probabilities to bf16 (2^-8 of each) before P @ V: an error up
        # to 2^-8 x sum(p |v|), under 2^-7 while the values average below 2 in magnitude (atol);
        # then the output is rounded to bf16, up to 2^-8 of its own value (rtol: outputs reach
        # 2.2 here, where half an ulp alone is 2^-7)
        torch.testing.assert_close(out.float().cpu()[:3], ref[:3], rtol=2**-8, atol=2**-7)


@pytest.mark.gpu
def test_prefill_of_a_long_prompt_needs_no_score_matrix_gpu() -> None:
    """One 8,192-token prompt, 16 heads: the fused SDPA kernels hold O(T) memory; the math
    fallback would hold the [H, T, T] scores (16 x 8192^2 x 2 bytes = 2 GiB, more in float32).
    Bound: the gathered K / V, the output and kernel scratch, far below 512 MiB."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    heads, head_dim, tokens = 16, 128, 8192
    num_blocks = tokens // BS + 1
    cache = torch.randn(2, num_blocks, BS, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(1, num_blocks, dtype=torch.int32, device="cuda")[None]
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prefill_attention_sdpa(q, cache, [0, tokens], [tokens], table, 0.088, out)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 512 << 20
    # a tail of the prompt checked against the reference (float32, on the CPU)
    ref = paged_attention_ref(
        q[-4:].float().cpu(), cache.float().cpu(), [0, 4], [tokens], table.cpu(), 0.088
    )
    torch.testing.assert_close(out[-4:].float().cpu(), ref, rtol=0, atol=2e-2)

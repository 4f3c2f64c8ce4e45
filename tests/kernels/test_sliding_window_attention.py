"""Sliding-window attention in the Triton kernels against the torch reference.

Paged attention (prefill, chunked prefill over a cached prefix, decode, mixed batches, split-KV)
and the fused decode kernel, for windows smaller than, equal to, not a multiple of and larger
than the block size. As the KV cache manager does, blocks wholly before a sequence's first
window are the null block in the table; here they and every key before the window are NaN in
the kernel's cache, so a kernel that read (even masked) one of them would return NaN. CPU runs
the kernels under TRITON_INTERPRET=1 on small shapes; `gpu` cases add 7B shapes and graphs.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.attention.reference import (
    fused_decode_attention_ref,
    paged_attention_ref,
)
from pagoda.kernels.attention.triton_paged_attention import effective_kv_len, paged_attention_triton
from tests.kernels.test_fused_decode_attention import (
    DEVICE,
    Case,
    make_case,
    run_fused,
)
from tests.kernels.test_triton_paged_attention import (
    Batch,
    assert_close,
    make_batch,
    run_triton,
)


def _drop_out_of_window(
    cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int], q_lens: list[int], window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache and block tables as the kernel sees them with a window: blocks
    before the first query's window are the null block, keys before the window are NaN."""
    cache = cache.clone()
    tables = tables.clone()
    block_size = cache.shape[2]
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        lo = max(0, seq_len - q_len - window + 1)  # first key the first query sees
        for pos in range(lo):
            cache[:, int(tables[b, pos // block_size]), pos % block_size] = float("nan")
        tables[b, : lo // block_size] = 0  # block 0 is NaN too (never written)
    return cache, tables


def _check_paged(batch: Batch, window: int, **kwargs) -> None:
    q_lens = [e - s for s, e in zip(batch.query_start_loc_cpu, batch.query_start_loc_cpu[1:])]
    ref = paged_attention_ref(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_tables,
        batch.scale,
        sliding_window=window,
    )
    batch.kv_cache, batch.block_tables = _drop_out_of_window(
        batch.kv_cache, batch.block_tables, batch.seq_lens_cpu, q_lens, window
    )
    out = run_triton(batch, sliding_window=window, **kwargs)
    assert_close(out, ref, batch.q.dtype)


# Windows around the block size 16: below, equal, not a multiple, above, one 64-key tile, and
# one longer than every sequence (no key cut off, yet the code path is on).
WINDOWS = [1, 5, 16, 24, 40, 64, 1000]
# Cached prefix + chunk, fresh prompts, decodes at block edges and long ones, a 1-token one.
SPECS = [(1, 90), (20, 70), (1, 17), (33, 33), (1, 1), (5, 40), (70, 70)]


@pytest.mark.parametrize("window", WINDOWS)
def test_paged_mixed_batch(window):
    batch = make_batch(SPECS, 8, 2, 64, torch.float32, seed=window)
    _check_paged(batch, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [7, 24])
def test_paged_half_precision_gqa7(dtype, window):
    batch = make_batch(SPECS, 14, 2, 128, dtype, seed=window + 1)
    _check_paged(batch, window)


@pytest.mark.parametrize("window", [5, 16, 40])
def test_paged_decode_only(window):
    specs = [(1, n) for n in (1, 15, 16, 17, 64, 130, 300)]
    _check_paged(make_batch(specs, 8, 2, 64, torch.float32, seed=window), window)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("window", [5, 24, 200])
def test_paged_split_kv(window, num_splits):
    """Forced split-KV over the window (decodes) and over prefill tiles, where a split may lie
    wholly outside some rows' windows (m = -inf there)."""
    specs = [(1, 300), (1, 33), (40, 120), (1, 2)]
    _check_paged(
        make_batch(specs, 8, 2, 64, torch.float32, seed=num_splits), window, num_splits=num_splits
    )


def test_paged_block_size_32_and_window_not_multiple():
    batch = make_batch(SPECS, 8, 2, 64, torch.float32, block_size=32, seed=9)
    _check_paged(batch, 37)


def test_paged_window_larger_than_context_equals_full_attention():
    """A window no query reaches past is full causal attention (same kernel path, SLIDING on)."""
    batch = make_batch(SPECS, 8, 2, 64, torch.float32, seed=11)
    full = run_triton(batch)
    windowed = run_triton(batch, sliding_window=max(batch.seq_lens_cpu))
    torch.testing.assert_close(windowed, full, rtol=1e-5, atol=1e-5)
    # and a window that does cut keys off changes the result
    assert not torch.allclose(run_triton(batch, sliding_window=8), full, atol=1e-3)


def test_effective_kv_len():
    assert effective_kv_len(32768, 1, None) == 32768
    assert effective_kv_len(32768, 1, 4096) == 4096
    assert effective_kv_len(32768, 512, 4096) == 4096 + 511
    assert effective_kv_len(100, 1, 4096) == 100


def test_bad_window():
    batch = make_batch([(1, 5)], 8, 2, 64, torch.float32)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            paged_attention_triton(
                batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                batch.block_tables, batch.scale, 1, 5, sliding_window=bad,
            )  # fmt: skip


# ---- fused decode attention -----------------------------------------------------------------


def _check_fused(case: Case, window: int, **kwargs) -> torch.Tensor:
    """Fused kernel (dropped blocks / keys NaN) against the unfused reference with the window;
    the new tokens' K/V land in the cache exactly as the reference writes them."""
    n = case.num_real
    cache_ref = case.kv_cache.clone()
    ref = fused_decode_attention_ref(
        case.positions, case.q, case.k, case.v, case.cos, case.sin, cache_ref, case.slot_mapping,
        case.query_start_loc.tolist(), case.seq_lens_cpu, case.block_tables, case.scale,
        sliding_window=window,
    )  # fmt: skip
    cache, tables = _drop_out_of_window(
        case.kv_cache, case.block_tables, case.seq_lens_cpu, [1] * len(case.seq_lens_cpu), window
    )
    windowed = Case(**{**case.__dict__, "kv_cache": cache, "block_tables": tables})
    out = run_fused(windowed, cache, sliding_window=window, **kwargs)
    assert_close(out[:n], ref[:n], case.q.dtype)
    assert not out[n:].isnan().any()
    written = case.slot_mapping[:n]
    flat, flat_ref = cache.flatten(1, 2), cache_ref.flatten(1, 2)  # [2, N * bs, Hkv, D]
    assert torch.equal(flat[:, written], flat_ref[:, written])
    return out


SEQ_LENS = [1, 15, 16, 17, 70, 300]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 5, 16, 24, 100])
def test_fused_decode(window, num_splits):
    case = make_case(SEQ_LENS, 8, 2, 64, torch.bfloat16, seed=window)
    _check_fused(case, window, num_splits=num_splits)


# 64 splits run compiled (`-m gpu`): under the interpreter they took 40 s and 23 s of CI; 8
# splits of these lengths already leave most chunks empty.
_GPU_64 = pytest.param(64, marks=pytest.mark.gpu)


@pytest.mark.parametrize("num_splits", [2, 8, _GPU_64])
def test_fused_decode_many_splits_over_window(num_splits):
    case = make_case([300, 33, 2, 129], 14, 2, 128, torch.float32, num_padding=2, seed=3)
    _check_fused(case, 40, num_splits=num_splits)


def test_fused_decode_block_size_32():
    case = make_case(SEQ_LENS, 8, 2, 64, torch.float32, block_size=32, seed=6)
    _check_fused(case, 37, num_splits=1)


# ---- GPU --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_mistral_shapes_long_context(num_splits):
    """Mistral-7B heads (32 q / 8 kv, D = 128), window 4096: a 1024-token chunk over a long
    prefix, a fresh 6k prompt and 20k-token decodes."""
    specs = [(1024, 12000), (6000, 6000), (1, 20000), (1, 4097), (1, 9)]
    batch = make_batch(specs, 32, 8, 128, torch.bfloat16, seed=31)
    _check_paged(batch, 4096, num_splits=num_splits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_gpu_fused_decode_mistral_shapes(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    lens = [int(n) for n in torch.randint(1, 20000, (batch_size,), generator=g)]
    case = make_case(lens, 32, 8, 128, torch.bfloat16, seed=batch_size)
    _check_fused(case, 4096)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_keeps_window():
    """Decode captured once (window and split count baked in) replays correctly for new
    lengths and tables, windowed both times."""
    first = make_batch([(1, s) for s in (5000, 900, 17, 12000)], 32, 8, 128, torch.bfloat16)
    second = make_batch([(1, s) for s in (13, 16000, 4100, 777)], 32, 8, 128, torch.bfloat16)
    window = 4096
    refs = []
    for b in (first, second):
        ref = paged_attention_ref(
            b.q, b.kv_cache, b.query_start_loc_cpu, b.seq_lens_cpu, b.block_tables, b.scale,
            sliding_window=window,
        )  # fmt: skip
        refs.append(ref)
        b.kv_cache, b.block_tables = _drop_out_of_window(
            b.kv_cache, b.block_tables, b.seq_lens_cpu, [1] * 4, window
        )
    q = first.q.clone()
    num_blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    cache = torch.full_like(second.kv_cache[:, :1].expand(-1, num_blocks, -1, -1, -1), float("nan"))
    cache[:, : first.kv_cache.shape[1]] = first.kv_cache
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    tables = torch.zeros(4, width, dtype=torch.int32, device=DEVICE)
    tables[:, : first.block_tables.shape[1]] = first.block_tables
    seq_lens = first.seq_lens.clone()
    out = torch.empty_like(q)

    def step() -> None:
        paged_attention_triton(
            q, cache, first.query_start_loc, seq_lens, tables, first.scale, 1, 16000,
            out=out, num_splits=8, sliding_window=window,
        )  # fmt: skip

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    assert_close(out, refs[0], torch.bfloat16)
    q.copy_(second.q)
    cache.fill_(float("nan"))
    cache[:, : second.kv_cache.shape[1]] = second.kv_cache
    tables.zero_()
    tables[:, : second.block_tables.shape[1]] = second.block_tables
    seq_lens.copy_(second.seq_lens)
    graph.replay()
    assert_close(out, refs[1], torch.bfloat16)

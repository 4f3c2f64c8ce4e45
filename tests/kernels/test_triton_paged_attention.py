"""Triton paged attention against `paged_attention_ref`: prefill, decode, mixed, GQA, split-KV.

Without CUDA the kernels run under TRITON_INTERPRET=1, set here before the kernel module is
imported (the variable is process-wide and read when `@triton.jit` runs), on small shapes. With
CUDA the same cases run compiled on the GPU; `gpu`-marked cases add Qwen2.5 shapes, 32k-token
decodes and CUDA-graph replay. Caches hold NaN outside each sequence's keys, outputs start NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1" and tuple(
    int(part) for part in triton.__version__.split(".")[:2]
) < (3, 7):
    # Its interpreter calls int() on 1-element arrays (loop bounds read from memory), which
    # numpy >= 2.4 rejects; 3.7 fixed it. The compiled GPU path is unaffected.
    pytest.skip("CPU tests need triton >= 3.7 (interpreter bug)", allow_module_level=True)

from pagoda.kernels.attention.reference import paged_attention_ref  # noqa: E402
from pagoda.kernels.attention.triton_paged_attention import (  # noqa: E402
    choose_num_splits,
    effective_kv_len,
    kernel_variant,
    mixed_step_variants,
    paged_attention_triton,
    warm_up_mixed_steps,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 runs with input_precision="ieee", so it is exact up to summation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, N, bs, Hkv, D]
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    scale: float


def make_batch(
    specs: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    block_size: int = 16,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """Random batch with shuffled block ids; cache slots no sequence owns are NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 4  # + null block 0 and spares
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=device
    )
    # Block 0 is the null block used for padding; the others are handed out in random order.
    perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
    block_tables = torch.zeros(len(specs), max(blocks_per_seq) + 2, dtype=torch.int32)
    first = 0
    for b, ((_, seq_len), n) in enumerate(zip(specs, blocks_per_seq, strict=True)):
        ids = perm[first : first + n]
        first += n
        block_tables[b, :n] = ids.to(torch.int32).cpu()
        keys = cache[:, ids].flatten(1, 2)  # copy: [2, n * bs, Hkv, D]
        keys[:, :seq_len] = torch.randn(
            2, seq_len, num_kv_heads, head_dim, generator=g, device=device
        )
        cache[:, ids] = keys.view(2, n, block_size, num_kv_heads, head_dim)
    query_start_loc = [0]
    for q_len, seq_len in specs:
        assert q_len <= seq_len
        query_start_loc.append(query_start_loc[-1] + q_len)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=g, device=device)
    seq_lens = [seq_len for _, seq_len in specs]
    return Batch(
        q=q.to(dtype),
        kv_cache=cache.to(dtype),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=max(q_len for q_len, _ in specs),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def run_triton(batch: Batch, *, extra_rows: int = 3, **kwargs) -> torch.Tensor:
    """Output into a NaN-poisoned buffer with `extra_rows` spare rows that must stay NaN."""
    num_tokens, num_heads, head_dim = batch.q.shape
    out = torch.full(
        (num_tokens + extra_rows, num_heads, head_dim),
        float("nan"),
        dtype=batch.q.dtype,
        device=batch.q.device,
    )
    result = paged_attention_triton(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
        out=out,
        **kwargs,
    )
    assert result is out
    assert out[num_tokens:].isnan().all(), "rows past the last query were written"
    return out[:num_tokens]


def reference(batch: Batch) -> torch.Tensor:
    return paged_attention_ref(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_tables,
        batch.scale,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements unwritten / NaN"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


def check(batch: Batch, **kwargs) -> None:
    assert_close(run_triton(batch, **kwargs), reference(batch), batch.q.dtype)


ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (num_heads, num_kv_heads): GQA ratios 1, 4, 7 (Qwen2.5-7B: 28 over 4) and 8 (Qwen2.5-3B).
GQA = [(4, 4), (8, 2), (28, 4), (16, 2)]
GQA_IDS = ["gqa1", "gqa4", "gqa7", "gqa8"]
# Cached prefix + chunk, fresh prompt, decodes at block edges (16, 17) and a 1-token sequence.
MIXED = [(1, 50), (20, 70), (1, 17), (9, 9), (1, 16), (1, 1), (5, 40)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_prefill_only(dtype):
    specs = [(37, 37), (16, 16), (1, 1), (70, 70)]
    check(make_batch(specs, 8, 2, 64, dtype, seed=1))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA, ids=GQA_IDS)
def test_decode_only(num_heads, num_kv_heads):
    specs = [(1, s) for s in (1, 15, 16, 17, 100, 300)]
    check(make_batch(specs, num_heads, num_kv_heads, 128, torch.bfloat16, seed=2))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA, ids=GQA_IDS)
def test_mixed_batch(num_heads, num_kv_heads, head_dim):
    check(make_batch(MIXED, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=head_dim))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_mixed_batch_dtypes(dtype):
    check(make_batch(MIXED, 28, 4, 128, dtype, seed=4))


def test_long_prefill_chunk_over_cached_prefix():
    """Query tiles of one sequence span several programs, each with its own causal limit."""
    check(make_batch([(150, 230), (1, 40)], 8, 8, 64, torch.float32, seed=5))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_splits"),
    [(8, 2, 2), (8, 2, 3), (8, 2, 8), (8, 2, 64), (28, 4, 2), (28, 4, 3)],
)
def test_split_kv_forced(num_heads, num_kv_heads, num_splits):
    """Split-KV decode; with 64 splits most chunks of the shorter sequences are empty."""
    specs = [(1, 300), (1, 33), (1, 1), (1, 129)]
    batch = make_batch(specs, num_heads, num_kv_heads, 128, torch.bfloat16, seed=6)
    check(batch, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_mixed_batch(dtype):
    """The split path is general: forcing it on a prefill + decode batch stays correct."""
    check(make_batch(MIXED, 8, 2, 64, dtype, seed=7), num_splits=3)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dim_not_power_of_two(head_dim):
    check(make_batch(MIXED, 8, 2, head_dim, torch.float16, seed=8))
    check(make_batch([(1, 100), (1, 37)], 8, 2, head_dim, torch.float16, seed=9), num_splits=2)


def test_block_size_32():
    check(make_batch(MIXED, 8, 2, 64, torch.bfloat16, block_size=32, seed=10))


def test_strided_q_and_out():
    """q as a view into a fused QKV output; out as a view into a wider buffer."""
    batch = make_batch(MIXED, 8, 2, 64, torch.float16, seed=11)
    num_tokens = batch.q.shape[0]
    qkv = torch.randn(num_tokens, 8 * 64 + 2 * 2 * 64, dtype=batch.q.dtype, device=DEVICE)
    qkv[:, : 8 * 64] = batch.q.flatten(1)
    batch.q = qkv[:, : 8 * 64].view(num_tokens, 8, 64)
    wide = torch.full((num_tokens, 2, 8, 64), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    out = wide[:, 1]
    paged_attention_triton(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
        out=out,
    )
    assert wide[:, 0].isnan().all()
    assert_close(out, reference(batch), torch.float16)


def test_padded_tokens_and_empty_sequence():
    """T > query_start_loc[-1] (graph padding) and a sequence with no query this step."""
    batch = make_batch([(3, 20), (0, 9), (1, 40)], 8, 2, 64, torch.float32, seed=12)
    ref = reference(batch)
    pad = torch.randn(5, 8, 64, dtype=batch.q.dtype, device=DEVICE)
    batch.q = torch.cat([batch.q, pad])
    out = run_triton(batch)
    valid = batch.query_start_loc_cpu[-1]
    assert out[valid:].isnan().all()
    assert_close(out[:valid], ref, torch.float32)


def test_auto_split_choice():
    # Prefill or mixed batches never split; decode splits only when programs underfill the GPU.
    assert choose_num_splits(1, 4, 7, 32768, 132) == 1
    assert choose_num_splits(256, 4, 1, 32768, 132) == 1
    assert choose_num_splits(1, 4, 1, 200, 132) == 1
    assert choose_num_splits(1, 4, 1, 1024, 132) == 8  # one 128-key tile per split
    splits = choose_num_splits(1, 4, 1, 32768, 132)
    assert 2 <= splits <= 64
    assert choose_num_splits(8, 4, 1, 32768, 132) < splits


def test_bad_arguments():
    batch = make_batch([(1, 5)], 6, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        run_triton(batch)
    batch = make_batch([(1, 5)], 8, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        run_triton(batch, num_splits=0)


# ---- GPU: full model shapes -------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN = [(28, 4), (16, 2)]
QWEN_IDS = ["qwen2.5-7b", "qwen2.5-3b"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), QWEN, ids=QWEN_IDS)
def test_gpu_mixed_many_sequences(num_heads, num_kv_heads):
    """A realistic chunked-prefill step: fresh prompt, two chunks over a prefix, 120 decodes."""
    g = torch.Generator().manual_seed(21)
    decodes = [(1, int(s)) for s in torch.randint(1, 8192, (120,), generator=g)]
    specs = [(2048, 2048), (512, 3512), (1000, 1015), *decodes]
    check(make_batch(specs, num_heads, num_kv_heads, 128, torch.bfloat16, seed=21))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), QWEN, ids=QWEN_IDS)
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_long_context_decode(num_heads, num_kv_heads, num_splits):
    """32k+ decodes: automatic split-KV (None) and the single-pass kernel (1) agree with ref."""
    specs = [(1, 32768), (1, 40000), (1, 33)]
    batch = make_batch(specs, num_heads, num_kv_heads, 128, torch.bfloat16, seed=22)
    if num_splits is None:
        assert choose_num_splits(3, num_kv_heads, 1, 40000, 132) > 1
    check(batch, num_splits=num_splits)


@pytest.mark.gpu
@gpu
def test_gpu_long_prefill_chunk():
    """A 1024-token chunk after a 31k-token cached prefix, plus decodes."""
    specs = [(1024, 32768), (1, 20000), (1, 7)]
    check(make_batch(specs, 28, 4, 128, torch.bfloat16, seed=23))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gpu_prefill_8k(dtype):
    check(make_batch([(8192, 8192)], 28, 4, 128, dtype, seed=24))


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay():
    """Decode captured once with a fixed num_splits replays correctly for new lengths/tables."""
    first = make_batch([(1, s) for s in (4000, 900, 17, 12000)], 28, 4, 128, torch.bfloat16)
    second = make_batch([(1, s) for s in (13, 16000, 2500, 777)], 28, 4, 128, torch.bfloat16)
    # Static buffers sized for the larger of the two.
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
            out=out, num_splits=8,
        )  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    first.kv_cache = cache
    first.block_tables = tables
    assert_close(out, reference(first), torch.bfloat16)

    q.copy_(second.q)
    cache[:, : second.kv_cache.shape[1]] = second.kv_cache
    tables.zero_()
    tables[:, : second.block_tables.shape[1]] = second.block_tables
    seq_lens.copy_(second.seq_lens)
    graph.replay()
    second.kv_cache = cache
    second.block_tables = tables
    assert_close(out, reference(second), torch.bfloat16)


def _variant(q_len: int, kv_len: int, qpk: int, window: int | None) -> tuple:
    """What the wrapper compiles for a step with this longest query (split-KV: decode only)."""
    num_splits = choose_num_splits(1, 1, q_len, kv_len, 132)
    return kernel_variant(q_len, effective_kv_len(kv_len, q_len, window), qpk, num_splits)


@pytest.mark.parametrize(
    "qpk,max_model_len,window", [(8, 1024, None), (8, 32768, None), (1, 4096, None), (4, 8192, 64)]
)
def test_mixed_step_variants_cover_every_longest_query(qpk, max_model_len, window):
    """Every (longest query >= 2, context) an eager step can have maps to a variant in the
    warm-up list, each listed variant is distinct: nothing is left to compile mid-serving."""
    variants = mixed_step_variants(qpk, max_model_len, window)
    keys = [_variant(q, kv, qpk, window) for q, kv in variants]
    assert len(set(keys)) == len(keys) and all(kv >= q for q, kv in variants)
    for q_len in range(2, min(max_model_len, 300) + 1, 3):
        for kv_len in (q_len, min(max_model_len, q_len + 5000)):
            assert _variant(q_len, kv_len, qpk, window) in keys, (q_len, kv_len)


def test_warm_up_runs_each_variant_on_the_null_block():
    """The warm-up launches the kernel once per variant, reading only the zeroed null block."""
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    cache = torch.randn(2, 3, bs, kv_heads, dim, device=DEVICE)
    cache[:, 0].zero_()
    before = cache.clone()
    n = warm_up_mixed_steps(cache, heads, dim**-0.5, max_model_len=64)
    assert n == len(mixed_step_variants(heads // kv_heads, 64)) >= 2
    assert torch.equal(cache, before)  # nothing written

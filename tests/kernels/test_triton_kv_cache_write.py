"""Triton KV-cache write against `write_kv_cache_ref` (an exact copy, so results must be equal).

Without CUDA the kernel runs under TRITON_INTERPRET=1, set here before the kernel module is
imported (the variable is process-wide and read when `@triton.jit` runs). With CUDA the same
small cases run compiled on the GPU; `gpu`-marked cases add full-size shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagoda.kernels.attention.reference import write_kv_cache_ref  # noqa: E402
from pagoda.kernels.attention.triton_kv_cache_write import write_kv_cache_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    num_blocks: int = 12,
    block_size: int = 16,
    num_slots: int | None = None,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V as strided views of a fused QKV row, a random cache, distinct random slots."""
    g = torch.Generator().manual_seed(seed)
    kv_width = num_kv_heads * head_dim
    # [T, q | k | v]: k and v are non-contiguous views, as the attention layer passes them.
    qkv = torch.randn(num_tokens, 3 * kv_width, generator=g).to(dtype)
    key = qkv[:, kv_width : 2 * kv_width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * kv_width :].view(num_tokens, num_kv_heads, head_dim)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)
    num_slots = num_tokens if num_slots is None else num_slots
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_slots]
    slots[torch.rand(num_slots, generator=g) < 0.2] = -1  # padding tokens
    dev = torch.device(DEVICE)
    return key.to(dev), value.to(dev), cache.to(dev), slots.to(dev)


def _check(key, value, cache, slots) -> None:
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache_triton(key, value, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_write_matches_reference(dtype, head_dim, num_kv_heads):
    _check(*_case(37, num_kv_heads, head_dim, dtype, seed=head_dim + num_kv_heads))


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_write_other_head_dims(head_dim):
    """Non power-of-two head dims use masked lanes; 256 is the largest supported."""
    _check(*_case(19, 3, head_dim, torch.bfloat16, seed=head_dim))


def test_write_slot_mapping_shorter_than_key():
    """CUDA-graph padding: rows past len(slot_mapping) are ignored."""
    _check(*_case(24, 2, 64, torch.float16, num_slots=17, seed=7))


def test_write_casts_to_cache_dtype():
    key, value, cache, slots = _case(21, 2, 128, torch.float32, cache_dtype=torch.bfloat16, seed=3)
    if DEVICE == "cuda":
        _check(key, value, cache, slots)  # the GPU rounds to nearest even, as torch does
        return
    # The interpreter's fp32 -> bf16 cast truncates instead: allow one bf16 ulp.
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache_triton(key, value, cache, slots)
    torch.testing.assert_close(cache.float(), expected.float(), rtol=2**-7, atol=0)


def test_write_block_size_32_and_all_padding():
    _check(*_case(20, 4, 64, torch.bfloat16, block_size=32, seed=5))
    key, value, cache, slots = _case(9, 2, 64, torch.bfloat16, seed=6)
    before = cache.clone()
    write_kv_cache_triton(key, value, cache, torch.full_like(slots, -1))
    assert torch.equal(cache, before)


def test_write_empty_and_bad_shapes():
    key, value, cache, slots = _case(4, 2, 64, torch.float32)
    write_kv_cache_triton(key, value, cache, slots[:0])  # no tokens: no launch
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache_triton(key, value, cache[:, :, :, :1], slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_write_gpu_full_size():
    """One 8k-token prefill step of Qwen2.5-7B (4 KV heads x 128) into a large cache."""
    _check(*_case(8192, 4, 128, torch.bfloat16, num_blocks=8192, seed=11))
    _check(*_case(256, 2, 128, torch.bfloat16, num_blocks=65536, seed=12))

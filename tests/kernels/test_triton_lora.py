"""Triton LoRA sgmv kernel against `lora_sgmv_ref`, and the reference against plain matmuls.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before the kernel module is
imported), on small shapes: mixed segments of several lengths, slots -1, shrink and expand,
and the one-token-per-segment layout that CUDA-graph decode uses.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.kernels.lora import lora_sgmv_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segments(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(lengths).cumsum(0)
    return starts.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def test_reference_equals_per_token_matmul() -> None:
    g = torch.Generator().manual_seed(0)
    lengths, slots = [3, 1, 4, 2], [1, -1, 0, 1]
    x = torch.randn(10, 8, generator=g)
    w = torch.randn(2, 5, 8, generator=g)
    starts, seg_slots = _segments(lengths, slots)
    base = torch.randn(10, 5, generator=g)
    out = lora_sgmv_ref(x, w, starts.cpu(), seg_slots.cpu(), 4, base.clone(), add=True)
    token_slot = [s for n, s in zip(lengths, slots, strict=True) for _ in range(n)]
    for t, s in enumerate(token_slot):
        expected = base[t] + (w[s] @ x[t] if s >= 0 else 0)
        torch.testing.assert_close(out[t], expected)
    shrunk = lora_sgmv_ref(x, w, starts.cpu(), seg_slots.cpu(), 4, torch.empty(10, 5), add=False)
    assert torch.equal(shrunk[3], torch.zeros(5))  # the slot -1 segment


triton = pytest.importorskip("triton")
from pagoda.kernels.triton_lora import lora_sgmv_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths, slots",
    [
        ([5, 1, 17, 3], [2, -1, 0, 2]),  # prefill chunks and a decode, one without adapter
        ([1] * 6, [0, 1, -1, 1, 3, -1]),  # decode-only: one token per segment (CUDA graphs)
    ],
    ids=["mixed", "per-token"],
)
@pytest.mark.parametrize("n, k", [(24, 40), (40, 12)], ids=["shrink", "expand"])
def test_triton_matches_reference(lengths, slots, n, k, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    num_tokens = sum(lengths)
    x = torch.randn(num_tokens, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(4, n, k, generator=g).to(dtype).to(DEVICE)
    starts, seg_slots = _segments(lengths, slots)
    base = torch.randn(num_tokens, n, generator=g).to(dtype).to(DEVICE)
    expected = lora_sgmv_ref(x, w, starts, seg_slots, len(lengths), base.clone(), add=True)
    out = lora_sgmv_triton(
        x, w, starts, seg_slots, len(lengths), max(lengths), base.clone(), add=True
    )
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)

    # shrink into a fresh buffer: rows of segments without an adapter are not read
    fresh = lora_sgmv_triton(
        x, w, starts, seg_slots, len(lengths), max(lengths), torch.empty_like(base), add=False
    )
    ref = lora_sgmv_ref(x, w, starts, seg_slots, len(lengths), torch.empty_like(base), add=False)
    used = torch.repeat_interleave(seg_slots.long(), (starts[1:] - starts[:-1]).long()) >= 0
    torch.testing.assert_close(fresh[used], ref[used], **tol)


def test_strided_input_rows() -> None:
    """x may be a column slice of a wider activation (as the layer never copies it)."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 48, generator=g).to(DEVICE)
    x = wide[:, 8:24]  # [6, 16], row stride 48
    w = torch.randn(2, 16, 16, generator=g).to(DEVICE)
    starts, seg_slots = _segments([2, 4], [1, 0])
    expected = lora_sgmv_ref(x, w, starts, seg_slots, 2, torch.zeros(6, 16, device=DEVICE), True)
    out = lora_sgmv_triton(x, w, starts, seg_slots, 2, 4, torch.zeros(6, 16, device=DEVICE), True)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(48, 2048), (22016, 32), (2560, 48), (2048, 16)])
def test_triton_full_size_bf16(n: int, k: int) -> None:
    """Qwen2.5-3B shapes (shrink of qkv, expand of gate_up / qkv / o_proj), mixed batch."""
    g = torch.Generator().manual_seed(3)
    lengths = [200, 1, 1, 37, 1, 64]
    slots = [0, 3, -1, 1, 0, 2]
    num_tokens = sum(lengths)
    x = (torch.randn(num_tokens, k, generator=g) / k**0.5).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(4, n, k, generator=g).to(torch.bfloat16).to(DEVICE)
    starts, seg_slots = _segments(lengths, slots)
    base = torch.randn(num_tokens, n, generator=g).to(torch.bfloat16).to(DEVICE)
    expected = lora_sgmv_ref(x, w, starts, seg_slots, len(lengths), base.clone(), add=True)
    out = lora_sgmv_triton(
        x, w, starts, seg_slots, len(lengths), max(lengths), base.clone(), add=True
    )
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)

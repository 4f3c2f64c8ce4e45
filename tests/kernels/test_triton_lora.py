"""Triton LoRA kernels against `lora_sgmv_ref` / `lora_shrink_expand_ref`, and the reference
against plain matmuls.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before the kernel module is
imported), on small shapes: mixed segments of several lengths, slots -1, shrink and expand,
the one-token-per-segment layout that CUDA-graph decode uses (with padding rows), and the
split-K shrink, whose workspace must be left zeroed by every launch.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.kernels.lora.ops import (  # noqa: E402
    lora_sgmv_ref,
    lora_shrink_expand,
    lora_shrink_expand_ref,
)
from pagoda.kernels.lora.workspace import lora_workspace  # noqa: E402

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
from pagoda.kernels.lora.triton_lora import (  # noqa: E402
    LoRAKernelConfig,
    choose_config,
    lora_gemm_triton,
    lora_sgmv_triton,
    lora_shrink_expand_triton,
    segments_to_token_slots,
)

LAYOUTS = {
    # prefill chunks and a decode, one request without adapter
    "mixed": [2] * 5 + [-1] + [0] * 17 + [2] * 3,
    # CUDA-graph decode: one token per request, then padding rows
    "per-token": [0, 1, -1, 1, 3, -1, 0, 0, -1, -1],
    "single": [3],  # batch 1 decode
    "none": [-1, -1, -1],  # no adapter at all (a captured graph's idle replay)
}
CFG_SPLIT3 = LoRAKernelConfig(16, 16, 32, 3, 4)  # shrink: split 3 ways (these K are short)
CFG_EXPAND_M16 = LoRAKernelConfig(16, 32, 16, 1, 4)  # expand: token tiles of 16


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def _assert_workspace_clean(ws) -> None:
    dirty = ws.acc.any() or ws.counters.any()
    assert not dirty, "a launch left the workspace dirty"


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "n, k, config",
    [
        (24, 72, None),  # shrink, tiles and split chosen by choose_config
        (24, 72, LoRAKernelConfig(16, 16, 16, 3, 4)),  # shrink split 3 ways, two N tiles
        (20, 100, LoRAKernelConfig(32, 32, 16, 7, 4)),  # uneven: the last split is short
        (40, 12, None),  # expand
    ],
    ids=["shrink-auto", "shrink-split3", "shrink-split7", "expand"],
)
def test_gemm_per_token_slots(layout, n, k, config, dtype) -> None:
    """`lora_gemm_triton` (with and without split-K) equals the reference, add or not."""
    g = torch.Generator().manual_seed(4)
    token_slots = torch.tensor(LAYOUTS[layout], dtype=torch.int32, device=DEVICE)
    num_tokens = token_slots.shape[0]
    x = torch.randn(num_tokens, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(4, n, k, generator=g).to(dtype).to(DEVICE)
    base = torch.randn(num_tokens, n, generator=g).to(dtype).to(DEVICE)
    starts = torch.arange(num_tokens + 1, dtype=torch.int32, device=DEVICE)
    used = token_slots >= 0
    ws = lora_workspace(DEVICE, max_rows=32, max_cols=64, num_counters=256)
    for add in (True, False):
        expected = lora_sgmv_ref(x, w, starts, token_slots, num_tokens, base.clone(), add)
        out = lora_gemm_triton(x, w, token_slots, base.clone(), add, ws, config)
        torch.testing.assert_close(out[used], expected[used], **_tol(dtype))
        assert torch.equal(out[~used], base[~used])  # rows without adapter: never written
        _assert_workspace_clean(ws)


def test_choose_config_decode_shapes() -> None:
    """Qwen2.5-3B decode shapes split the shrink's K (every split non-empty), not the expand's;
    without room in the workspace nothing is split."""
    for t in (1, 16, 64, 256):
        for n, k in [(48, 2048), (16, 2048), (32, 2048), (16, 11008)]:
            cfg = choose_config(t, n, k, workspace_ok=True)
            k_blocks = triton.cdiv(k, cfg.block_k)
            assert cfg.split_k >= 8, (t, n, k, cfg)
            per_split = triton.cdiv(k_blocks, cfg.split_k)
            assert (cfg.split_k - 1) * per_split < k_blocks, cfg
            assert cfg.block_n >= 16 and cfg.block_n >= min(n, 128)
            assert choose_config(t, n, k, workspace_ok=False).split_k == 1
        for n, k in [(2560, 48), (2048, 16), (22016, 32)]:
            assert choose_config(t, n, k, workspace_ok=True).split_k == 1


def test_split_needs_workspace_room() -> None:
    """Inputs longer than the workspace rows fall back to one split; results still match."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=g).to(DEVICE)
    w = torch.randn(2, 16, 64, generator=g).to(DEVICE)
    token_slots = torch.tensor([0, 1] * 20, dtype=torch.int32, device=DEVICE)
    ws = lora_workspace(DEVICE, max_rows=16, max_cols=16, num_counters=64)
    starts = torch.arange(41, dtype=torch.int32, device=DEVICE)
    expected = lora_sgmv_ref(x, w, starts, token_slots, 40, torch.empty(40, 16), False)
    out = lora_gemm_triton(x, w, token_slots, torch.empty(40, 16, device=DEVICE), False, ws)
    torch.testing.assert_close(out, expected.to(DEVICE), atol=1e-4, rtol=1e-4)
    _assert_workspace_clean(ws)
    with pytest.raises(AssertionError):  # a forced split without room is refused
        lora_gemm_triton(x, w, token_slots, out, False, ws, LoRAKernelConfig(16, 16, 16, 2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shrink_expand_matches_reference(layout, dtype) -> None:
    """A whole LoRA layer (qkv-like: 3 shards of rank 4, then a down-like one), one workspace
    reused by consecutive layers; rows without adapter untouched."""
    g = torch.Generator().manual_seed(6)
    token_slots = torch.tensor(LAYOUTS[layout], dtype=torch.int32, device=DEVICE)
    num_tokens = token_slots.shape[0]
    ws = lora_workspace(DEVICE, max_rows=32, max_cols=32, num_counters=256)
    for n_in, n_out, rank in [(96, 40, 12), (40, 96, 4)]:
        x = torch.randn(num_tokens, n_in, generator=g).to(dtype).to(DEVICE)
        a = (torch.randn(4, rank, n_in, generator=g) / n_in**0.5).to(dtype).to(DEVICE)
        b = torch.randn(4, n_out, rank, generator=g).to(dtype).to(DEVICE)
        y0 = torch.randn(num_tokens, n_out, generator=g).to(dtype).to(DEVICE)
        expected = lora_shrink_expand_ref(x, a, b, token_slots, y0.clone())
        for configs in [(None, None), (CFG_SPLIT3, CFG_EXPAND_M16)]:  # chosen; forced split
            out = lora_shrink_expand_triton(x, a, b, token_slots, y0.clone(), ws, *configs)
            torch.testing.assert_close(out, expected, **_tol(dtype))
            assert torch.equal(out[token_slots < 0], y0[token_slots < 0])
            _assert_workspace_clean(ws)
    # the dispatcher runs the same kernels (interpreted on the CPU)
    out = lora_shrink_expand(x, a, b, token_slots, y0.clone(), ws)
    torch.testing.assert_close(out, expected, **_tol(dtype))


def test_segments_to_token_slots() -> None:
    starts, seg_slots = _segments([2, 1, 3], [4, -1, 0])
    padded_starts = torch.cat([starts, torch.tensor([99, 99], dtype=torch.int32, device=DEVICE)])
    got = segments_to_token_slots(padded_starts, seg_slots, 3, 8)  # 2 rows past the segments
    assert got.tolist() == [4, 4, -1, 0, 0, 0, -1, -1]
    assert got.dtype == torch.int32


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
@pytest.mark.parametrize(
    "n_in, n_out, rank_space",
    [(2048, 2560, 48), (2048, 2048, 16), (2048, 22016, 32), (11008, 2048, 16)],
    ids=["qkv", "o", "gate_up", "down"],
)
def test_shrink_expand_full_size_bf16(num_tokens, n_in, n_out, rank_space) -> None:
    """Qwen2.5-3B layers at decode batch sizes (split-K shrink), four adapters and -1 mixed."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, n_in, generator=g).to(torch.bfloat16).to(DEVICE)
    a = (torch.randn(4, rank_space, n_in, generator=g) / n_in**0.5).to(torch.bfloat16)
    b = (torch.randn(4, n_out, rank_space, generator=g) * 0.1).to(torch.bfloat16)
    a, b = a.to(DEVICE), b.to(DEVICE)
    slots = torch.tensor([(t % 5) - 1 for t in range(num_tokens)], dtype=torch.int32)
    token_slots = slots.to(DEVICE)
    y0 = torch.randn(num_tokens, n_out, generator=g).to(torch.bfloat16).to(DEVICE)
    ws = lora_workspace(DEVICE)
    expected = lora_shrink_expand_ref(x, a, b, token_slots, y0.clone())
    for _ in range(3):  # the workspace is reused launch after launch
        out = lora_shrink_expand_triton(x, a, b, token_slots, y0.clone(), ws)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)
    _assert_workspace_clean(ws)


@pytest.mark.gpu
def test_shrink_expand_in_cuda_graph() -> None:
    """Captured once, replayed with new token slots and inputs written into the static
    buffers: every replay equals the reference and leaves the workspace clean."""
    g = torch.Generator().manual_seed(8)
    num_tokens, n_in, n_out, rank_space = 16, 2048, 2560, 48
    a = (torch.randn(4, rank_space, n_in, generator=g) / n_in**0.5).to(torch.bfloat16)
    b = (torch.randn(4, n_out, rank_space, generator=g) * 0.1).to(torch.bfloat16)
    a, b = a.to(DEVICE), b.to(DEVICE)
    x = torch.zeros(num_tokens, n_in, dtype=torch.bfloat16, device=DEVICE)
    y = torch.zeros(num_tokens, n_out, dtype=torch.bfloat16, device=DEVICE)
    token_slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=DEVICE)
    ws = lora_workspace(DEVICE)
    lora_shrink_expand_triton(x, a, b, token_slots, y, ws)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # consecutive layers share the workspace
            lora_shrink_expand_triton(x, a, b, token_slots, y, ws)
    for step in range(4):
        x.copy_(torch.randn(num_tokens, n_in, generator=g).to(torch.bfloat16))
        y0 = torch.randn(num_tokens, n_out, generator=g).to(torch.bfloat16).to(DEVICE)
        y.copy_(y0)
        slots = [(t + step) % 5 - 1 for t in range(num_tokens)]
        token_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        expected = y0.clone()
        for _ in range(3):
            lora_shrink_expand_ref(x, a, b, token_slots, expected)
        torch.testing.assert_close(y, expected, atol=5e-2, rtol=2e-2)
    _assert_workspace_clean(ws)

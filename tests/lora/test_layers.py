"""`LoRALinearMethod` on a fused QKV layer: every batch layout adds the right low-rank terms.

The CPU grouped path, the CUDA per-request segment layout and the CUDA-graph per-token layout
(with padding rows) all equal `W x + B_q A_q x | B_k A_k x | B_v A_v x` per token. The CUDA
layouts run here through the Triton kernel under TRITON_INTERPRET=1 (or its reference).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.kernels.lora import ops as lora_kernels  # noqa: E402
from pagoda.layers.linear import QKVLinear  # noqa: E402
from pagoda.lora import layers as lora_layers  # noqa: E402
from pagoda.lora.layers import LoRABatch, LoRALinearMethod  # noqa: E402

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 32, 8, 4, 2
SIZES = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]  # q, k, v


def _layer_with_adapters():
    g = torch.Generator().manual_seed(0)
    layer = QKVLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
    batch = LoRABatch(64, torch.device("cpu"))
    method = LoRALinearMethod(
        layer.linear_method, layer, batch, 3, 4, torch.float32, torch.device("cpu")
    )
    layer.linear_method = method

    def pair(shard: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(r, HIDDEN, generator=g)
        b = torch.randn(SIZES[shard], r, generator=g)
        return a, b

    adapters = {
        0: [pair(0, 4), None, pair(2, 2)],  # q and v, different ranks
        2: [None, pair(1, 3), None],  # k only
    }
    for slot, pairs in adapters.items():
        method.set_slot(slot, pairs)
    return layer, batch, adapters


def _expected(layer, adapters, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    y = x @ layer.weight.T
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        parts = []
        for shard, pair in enumerate(adapters[slot]):
            parts.append(torch.zeros(SIZES[shard]) if pair is None else pair[1] @ pair[0] @ x[t])
        y[t] += torch.cat(parts)
    return y


def _as_if_cuda(monkeypatch) -> None:
    """Run the CUDA layouts on the CPU: no pinned memory, the Triton kernel (interpreted)."""
    monkeypatch.setattr(lora_layers, "_pinned", lambda v: torch.tensor(v, dtype=torch.int32))
    try:
        from pagoda.kernels.lora.triton_lora import lora_sgmv_triton
    except ImportError:
        lora_sgmv_triton = None
    if lora_sgmv_triton is not None:

        def sgmv(x, w, starts, slots, num_segs, max_seg_len, out, add):
            return lora_sgmv_triton(x, w, starts, slots, num_segs, max_seg_len, out, add)

        monkeypatch.setattr(lora_layers, "lora_sgmv", sgmv)


LENGTHS, REQUEST_SLOTS = [3, 1, 4, 2, 2], [0, -1, 2, 0, -1]
TOKEN_SLOTS = [s for n, s in zip(LENGTHS, REQUEST_SLOTS, strict=True) for _ in range(n)]


def test_cpu_grouped_path() -> None:
    layer, batch, adapters = _layer_with_adapters()
    x = torch.randn(sum(LENGTHS), HIDDEN)
    batch.set_per_request(REQUEST_SLOTS, LENGTHS)
    assert batch.active and len(batch.groups) == 2
    torch.testing.assert_close(layer(x), _expected(layer, adapters, x, TOKEN_SLOTS))

    batch.set_per_request([-1, -1], [4, 6])  # no adapter in the step: base output only
    assert not batch.active
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_cuda_per_request_layout(monkeypatch) -> None:
    _as_if_cuda(monkeypatch)
    layer, batch, adapters = _layer_with_adapters()
    batch.on_cuda = True
    x = torch.randn(sum(LENGTHS), HIDDEN)
    batch.set_per_request(REQUEST_SLOTS, LENGTHS)
    assert batch.num_segs == len(LENGTHS)
    expected = _expected(layer, adapters, x, TOKEN_SLOTS)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_cuda_graph_per_token_layout_with_padding(monkeypatch) -> None:
    _as_if_cuda(monkeypatch)
    layer, batch, adapters = _layer_with_adapters()
    batch.on_cuda = True
    decode_slots = [0, 2, -1, 0, 2]
    batch.set_per_token(decode_slots, padded=8)  # a graph of 8 rows for 5 decodes
    assert batch.num_segs is None
    x = torch.randn(8, HIDDEN)
    y = layer(x)
    expected = _expected(layer, adapters, x, decode_slots + [-1] * 3)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_reference_sgmv_matches_grouped_path() -> None:
    layer, batch, adapters = _layer_with_adapters()
    method = layer.linear_method
    x = torch.randn(sum(LENGTHS), HIDDEN)
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor(REQUEST_SLOTS, dtype=torch.int32)
    rank = lora_kernels.lora_sgmv_ref(
        x, method.lora_a, starts, slots, len(LENGTHS), torch.empty(x.shape[0], 12), add=False
    )
    y = lora_kernels.lora_sgmv_ref(
        rank, method.lora_b, starts, slots, len(LENGTHS), x @ layer.weight.T, add=True
    )
    torch.testing.assert_close(y, _expected(layer, adapters, x, TOKEN_SLOTS))


@pytest.mark.parametrize("slot", [0, 2])
def test_set_slot_overwrites_previous_adapter(slot: int) -> None:
    layer, batch, adapters = _layer_with_adapters()
    layer.linear_method.set_slot(slot, [])  # evicted: the slot adds nothing any more
    x = torch.randn(4, HIDDEN)
    batch.set_per_request([slot], [4])
    torch.testing.assert_close(layer(x), x @ layer.weight.T)

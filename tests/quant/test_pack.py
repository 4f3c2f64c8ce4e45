"""Packing: exact round trips, and bit-for-bit what compressed-tensors writes."""

from __future__ import annotations

import pytest
import torch

from pagoda.quant.packing import pack_to_int32, unpack_from_int32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(16, 64), (24, 40), (8, 37)])
def test_round_trip_exact(bits: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    values = torch.randint(lo, hi, shape, generator=g).to(torch.int8)
    packed = pack_to_int32(values, bits, packed_dim=1)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], -(-shape[1] * bits // 32))
    assert torch.equal(unpack_from_int32(packed, bits, shape[1], 1), values)
    if shape[0] % (32 // bits) == 0:
        packed0 = pack_to_int32(values, bits, packed_dim=0)
        assert packed0.shape == (shape[0] * bits // 32, shape[1])
        assert torch.equal(unpack_from_int32(packed0, bits, shape[0], 0), values)


def test_nibble_order_little_endian() -> None:
    # Element i of a row sits at bits 4i..4i+3 of the word, stored as value + 8.
    values = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)
    word = int(pack_to_int32(values, 4)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 1, 8, 9, 10, 11, 12, 15]


@pytest.mark.parametrize("bits", [4, 8])
def test_matches_compressed_tensors(bits: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(1)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (32, 72), generator=g)
    values = values.to(torch.int8)
    for dim in (0, 1):
        ours = pack_to_int32(values, bits, packed_dim=dim)
        theirs = helpers.pack_to_int32(values, bits, packed_dim=dim)
        assert torch.equal(ours, theirs)

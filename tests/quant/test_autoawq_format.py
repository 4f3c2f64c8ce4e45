"""AutoAWQ GEMM packing against the layout definition, written out independently here."""

from __future__ import annotations

import pytest
import torch

from pagoda.quant.formats.autoawq import (
    pack_awq_gemm,
    parse_awq_config,
    quantization_config,
    unpack_awq_gemm,
)

_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble i holds column _ORDER[i]


def _reference_dequantize(qweight, qzeros, scales):
    """[out, in] float weight from AutoAWQ tensors, one nibble at a time (no vectorised unpack)."""
    k, words = qweight.shape
    groups, n = scales.shape
    group = k // groups
    u = torch.zeros(k, n, dtype=torch.float64)
    z = torch.zeros(groups, n, dtype=torch.float64)
    for w in range(words):
        for i in range(8):
            col = 8 * w + _ORDER[i]
            u[:, col] = ((qweight[:, w].to(torch.int64) >> (4 * i)) & 15).double()
            z[:, col] = ((qzeros[:, w].to(torch.int64) >> (4 * i)) & 15).double()
    zk = z.repeat_interleave(group, dim=0)  # [in, out]
    sk = scales.double().repeat_interleave(group, dim=0)
    return ((u - zk) * sk).t()  # [out, in]


def _random(out=24, inp=64, group=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    zeros = torch.randint(-8, 8, (out, inp // group), generator=g).to(torch.int16)
    scales = (torch.rand(out, inp // group, generator=g) * 0.01 + 0.001).to(torch.float16)
    return codes, scales, zeros


def test_nibble_order_of_one_word():
    # columns 0..7 hold the values 1..8: nibble i must hold column _ORDER[i] + 1
    codes = (torch.arange(1, 9, dtype=torch.int16) - 8).to(torch.int8).view(8, 1)  # [out=8, in=1]
    qweight, _, _ = pack_awq_gemm(codes, torch.ones(8, 1), None)
    word = int(qweight[0, 0]) & 0xFFFFFFFF
    expected = sum((_ORDER[i] + 1) << (4 * i) for i in range(8))
    assert word == expected


def test_pack_matches_reference_dequantization():
    codes, scales, zeros = _random()
    qweight, qzeros, s = pack_awq_gemm(codes, scales, zeros)
    assert qweight.shape == (64, 3) and qzeros.shape == (4, 3) and s.shape == (4, 24)
    assert qweight.dtype == torch.int32 and s.dtype == torch.float16
    ref = _reference_dequantize(qweight, qzeros, s)
    zk = zeros.double().repeat_interleave(16, 1)  # [out, in]
    expected = (codes.double() - zk) * scales.double().repeat_interleave(16, 1)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)


def test_unpack_inverts_pack():
    codes, scales, zeros = _random(out=16, inp=128, group=32, seed=3)
    c2, s2, z2 = unpack_awq_gemm(*pack_awq_gemm(codes, scales, zeros))
    assert torch.equal(c2, codes) and torch.equal(z2, zeros) and torch.equal(s2, scales)
    assert c2.dtype == torch.int8 and z2.dtype == torch.int16


def test_unpack_of_reference_words():
    # words built by hand from the layout: unpack must give back the columns
    g = torch.Generator().manual_seed(7)
    u = torch.randint(0, 16, (32, 16), generator=g)  # [in, out] unsigned codes
    words = torch.zeros(32, 2, dtype=torch.int64)
    for w in range(2):
        for i in range(8):
            words[:, w] |= u[:, 8 * w + _ORDER[i]] << (4 * i)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)
    qzeros = torch.full((1, 2), 0x88888888 - (1 << 32), dtype=torch.int32)  # every zero = 8
    codes, _, zeros = unpack_awq_gemm(qweight, qzeros, torch.ones(1, 16, dtype=torch.float16))
    assert torch.equal(codes.to(torch.int64), (u - 8).t())
    assert not zeros.any()


def test_symmetric_pack_stores_midpoint_zero():
    codes, scales, _ = _random()
    _, qzeros, _ = pack_awq_gemm(codes, scales, None)
    assert torch.all((qzeros.to(torch.int64) & 0xFFFFFFFF) == 0x88888888)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            (
                torch.zeros(64, 3, dtype=torch.int32),
                torch.zeros(3, 3, dtype=torch.int32),
                torch.ones(3, 24),
            ),
            "does not divide",
        ),
        (
            (
                torch.zeros(64, 3, dtype=torch.int32),
                torch.zeros(4, 2, dtype=torch.int32),
                torch.ones(4, 24),
            ),
            "do not fit together",
        ),
        (
            (
                torch.zeros(64, 3, dtype=torch.int64),
                torch.zeros(4, 3, dtype=torch.int32),
                torch.ones(4, 24),
            ),
            "must be int32",
        ),
    ],
)
def test_unpack_errors(tensors, message):
    with pytest.raises(ValueError, match=message):
        unpack_awq_gemm(*tensors)


def test_pack_rejects_out_of_range_and_bad_shapes():
    codes, scales, zeros = _random()
    with pytest.raises(ValueError, match="-8..7"):
        pack_awq_gemm(codes.to(torch.int16) + 8, scales, zeros)
    with pytest.raises(ValueError, match="out_features % 8"):
        pack_awq_gemm(codes[:20], scales[:20], zeros[:20])


def test_config_round_trip_and_errors():
    cfg = parse_awq_config(quantization_config(64, True, ["lm_head"]))
    assert (cfg.group_size, cfg.zero_point, cfg.version) == (64, True, "gemm")
    assert cfg.modules_to_not_convert == ("lm_head",)
    own = parse_awq_config(
        {"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "version": "GEMM"}
    )
    assert own.group_size == 32
    with pytest.raises(ValueError, match="version='gemv' is not supported"):
        parse_awq_config({"quant_method": "awq", "bits": 4, "version": "gemv"})
    with pytest.raises(ValueError, match="w_bit=8"):
        parse_awq_config({"quant_method": "awq", "bits": 8, "version": "gemm"})

"""W4A16 / W8A16 weights: int32 packing as compressed-tensors does it, and torch references.

Packing follows compressed-tensors `pack_to_int32`: signed values are offset to unsigned
(+2^(bits-1)) and element i of a row lands in word i // (32 / bits) at bit (i % (32 / bits)) *
bits (little-endian nibble order). `wna16_linear_ref` dequantizes and multiplies: the oracle
of the Triton kernel and the CPU fallback.
"""

from __future__ import annotations

import torch


def pack_factor(num_bits: int) -> int:
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits={num_bits} is not supported; use 4 or 8")
    return 32 // num_bits


def pack_to_int32(values: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed int values [rows, cols] (in [-2^(b-1), 2^(b-1))) into int32 along a dim.

    packed_dim=1: [rows, ceil(cols / f)]; packed_dim=0: [ceil(rows / f), cols]; f = 32 / bits.
    """
    factor = pack_factor(num_bits)
    if packed_dim == 0:
        return pack_to_int32(values.t(), num_bits, 1).t().contiguous()
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))  # [rows, cols] in [0, 2^b)
    pad = (-cols) % factor
    if pad:
        unsigned = torch.nn.functional.pad(unsigned, (0, pad))
    unsigned = unsigned.view(rows, -1, factor)  # [rows, words, factor]
    shifts = torch.arange(factor, device=values.device, dtype=torch.int64) * num_bits
    words = (unsigned << shifts).sum(dim=-1)  # [rows, words], < 2^32: no overlap between fields
    # Reinterpret the low 32 bits as a signed int32 (what safetensors stores).
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_from_int32(
    packed: torch.Tensor, num_bits: int, size: int, packed_dim: int = 1
) -> torch.Tensor:
    """Inverse of `pack_to_int32`: int8 signed values with `size` elements along `packed_dim`."""
    factor = pack_factor(num_bits)
    if packed_dim == 0:
        return unpack_from_int32(packed.t(), num_bits, size, 1).t().contiguous()
    shifts = torch.arange(factor, device=packed.device, dtype=torch.int32) * num_bits
    mask = (1 << num_bits) - 1
    # Arithmetic shift of a negative word smears the sign bit, the mask removes it.
    fields = (packed.unsqueeze(-1) >> shifts) & mask  # [rows, words, factor]
    values = fields.reshape(packed.shape[0], -1)[:, :size]
    return (values - (1 << (num_bits - 1))).to(torch.int8)


def expand_groups(
    per_group: torch.Tensor, in_features: int, group_size: int, g_idx: torch.Tensor | None
) -> torch.Tensor:
    """[out, num_groups] -> [out, in_features]: each input column gets its group's value."""
    if g_idx is not None:
        return per_group[:, g_idx.long()]
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_weight(
    qweight: torch.Tensor,  # [out, in] int8 signed values
    scale: torch.Tensor,  # [out, num_groups]
    zero_point: torch.Tensor | None,  # [out, num_groups] int8, None when symmetric
    group_size: int,  # in_features for per-channel
    g_idx: torch.Tensor | None = None,  # [in] group of each input column (act-order "group")
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [out, in]
    """w = (q - zero_point) * scale, in `dtype` (default: the scale's dtype)."""
    dtype = dtype or scale.dtype
    in_features = qweight.shape[1]
    q = qweight.to(torch.float32)
    if zero_point is not None:
        q = q - expand_groups(zero_point.to(torch.float32), in_features, group_size, g_idx)
    w = q * expand_groups(scale.to(torch.float32), in_features, group_size, g_idx)
    return w.to(dtype)


def wna16_linear_ref(
    x: torch.Tensor,  # [M, in]
    qweight: torch.Tensor,  # [out, in] int8
    scale: torch.Tensor,  # [out, num_groups]
    zero_point: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, out]
    """Reference quantized linear: dequantize in float32, matmul, cast to x's dtype."""
    w = dequantize_weight(qweight, scale, zero_point, group_size, g_idx, torch.float32)
    out = x.to(torch.float32) @ w.t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)

"""Integer codes packed into int32 words, as compressed-tensors and GPTQ store them.

Signed values are offset to unsigned (+2^(bits-1)) and element i of a row lands in word
i // (32 / bits) at bit (i % (32 / bits)) * bits (little-endian nibble order). Pure torch, no
other pagoda imports: the checkpoint formats, the runtime layer and the kernels' references
all use it.
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

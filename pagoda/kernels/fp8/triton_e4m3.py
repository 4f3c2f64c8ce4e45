"""e4m3 codes to float32 with integer operations, for GPUs whose Triton has no e4m3 conversion.

Triton converts `float8e4nv` from sm_89 on; Ampere (sm_80) and the Jetson Orin (sm_87) load the
codes as uint8 and decode them here: a normal code (exponent e > 0, mantissa m) is
2^(e - 7) (1 + m / 8), i.e. the bf16 whose exponent is e + 120 and whose top three mantissa bits
are m — the code's low seven bits shifted left by four plus 120 << 7, placed in the upper half
of a float32 word; a subnormal one (e = 0) is m 2^-9. Exact for every finite code (the NaN codes
0x7f / 0xff never occur in a weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_bits_to_f32(codes):
    v = codes.to(tl.int32)
    em = v & 0x7F
    normal = (((em << 4) + (120 << 7)) << 16).to(tl.float32, bitcast=True)
    mag = tl.where(em >= 8, normal, em.to(tl.float32) * 0.001953125)
    return tl.where((v & 0x80) != 0, -mag, mag)


@triton.jit
def _decode_kernel(c_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    codes = tl.load(c_ptr + offs, mask=offs < n, other=0)
    tl.store(o_ptr + offs, e4m3_bits_to_f32(codes), mask=offs < n)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e4m3 codes, through `e4m3_bits_to_f32` (its test)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    codes = codes.contiguous()
    out = torch.empty(codes.shape, device=codes.device, dtype=torch.float32)
    n = codes.numel()
    _decode_kernel[(triton.cdiv(n, 256),)](codes, out, n, BLOCK=256)
    return out

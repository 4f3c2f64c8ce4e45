"""e4m3 codes to float32 with integer operations, for GPUs whose Triton has no e4m3 conversion.

Triton converts `float8e4nv` from sm_89 on; Ampere (sm_80) and the Jetson Orin (sm_87) load the
codes as uint8 and decode them here: a normal code (exponent e > 0, mantissa m) is
2^(e - 7) (1 + m / 8), i.e. the bf16 whose exponent is e + 120 and whose top three mantissa bits
are m — the code's low seven bits shifted left by four plus 120 << 7, placed in the upper half
of a float32 word; a subnormal one (e = 0) is m 2^-9. Exact for every finite code (the NaN codes
0x7f / 0xff never occur in a weight).

`e4m3_bits_to_f16` does it in 16 bits, for tiles read in bulk (the attention kernels' K / V
tiles): the code's low seven bits shifted left by seven and its sign moved to bit 15 are the
fp16 of the value times 2^-8, for every code at once — fp16's exponent bias is 15 against
e4m3's 7, and e4m3's subnormals (m 2^-9) land on fp16's (m 2^7 2^-24) — so one multiply by 2^8
(exact: fp16 arithmetic keeps subnormals) gives the value: no branch, half the registers.

The FP8 KV cache writes e4m3 there too: `f32_to_e4m3_bits` rounds a float32 (already clamped to
+-448) to the nearest code, ties to even, as `torch.Tensor.to(torch.float8_e4m3fn)` does. A
normal value keeps its exponent and the top three of its 23 mantissa bits, rounded on the 20
dropped ones (a carry moves into the exponent, as it should); below 2^-6 the code is |x| 2^9
rounded to an integer 0..8, from the 24-bit significand shifted right by 141 - the float32
exponent field.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda import platform


def needs_soft_e4m3(device: torch.device) -> bool:
    """Whether Triton lacks the e4m3 conversion on `device` (CUDA below sm_89)."""
    return device.type == "cuda" and platform.capability(device) < (8, 9)


def soft_e4m3_view(t: torch.Tensor, soft_e4m3: bool | None) -> torch.Tensor:
    """`t` as a kernel reads it: an e4m3 tensor (an FP8 KV cache) as its uint8 codes where Triton
    has no e4m3 conversion (`soft_e4m3` None: an e4m3 tensor on CUDA below sm_89); the kernel
    then decodes and encodes the codes with the functions here. Other tensors pass through."""
    if soft_e4m3 is None:
        soft_e4m3 = t.dtype == torch.float8_e4m3fn and needs_soft_e4m3(t.device)
    if not soft_e4m3:
        return t
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"soft_e4m3 takes a float8_e4m3fn tensor, got {t.dtype}")
    return t.view(torch.uint8)


@triton.jit
def e4m3_bits_to_f32(codes):
    v = codes.to(tl.int32)
    em = v & 0x7F
    normal = (((em << 4) + (120 << 7)) << 16).to(tl.float32, bitcast=True)
    mag = tl.where(em >= 8, normal, em.to(tl.float32) * 0.001953125)
    return tl.where((v & 0x80) != 0, -mag, mag)


@triton.jit
def e4m3_bits_to_f16(codes):
    v = codes.to(tl.uint16)
    bits = ((v & 0x80) << 8) | ((v & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def f32_to_e4m3_bits(x):
    b = x.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normal (|x| >= 2^-6, float32 bits 0x3C800000): 3 of 23 mantissa bits, ties to even
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: round the significand m (|x| = m 2^(e - 150)) times 2^9, i.e. m >> (141 - e)
    shift = tl.minimum(141 - (a >> 23), 25)
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> shift
    rem = m - (q << shift)
    half = (m * 0 + 1) << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.minimum(tl.where(a >= 0x3C800000, normal, q), 0x7E)
    return (sign | mag).to(tl.uint8)


@triton.jit
def _convert_kernel(
    src_ptr, dst_ptr, n, ENCODE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0)
    if ENCODE:
        tl.store(dst_ptr + offs, f32_to_e4m3_bits(x), mask=offs < n)
    elif HALF:
        tl.store(dst_ptr + offs, e4m3_bits_to_f16(x), mask=offs < n)
    else:
        tl.store(dst_ptr + offs, e4m3_bits_to_f32(x), mask=offs < n)


def _convert(src: torch.Tensor, encode: bool, half: bool = False) -> torch.Tensor:
    want, out_dtype = (torch.float32, torch.uint8) if encode else (torch.uint8, torch.float32)
    if half:
        out_dtype = torch.float16
    if src.dtype != want:
        raise ValueError(f"{'x' if encode else 'codes'} must be {want}, got {src.dtype}")
    src = src.contiguous()
    out = torch.empty(src.shape, device=src.device, dtype=out_dtype)
    n = src.numel()
    _convert_kernel[(triton.cdiv(n, 256),)](src, out, n, ENCODE=encode, HALF=half, BLOCK=256)
    return out


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of float32 values in +-448, through `f32_to_e4m3_bits` (its test)."""
    return _convert(x, encode=True)


def decode_e4m3(codes: torch.Tensor, half: bool = False) -> torch.Tensor:
    """float32 values of uint8 e4m3 codes, through `e4m3_bits_to_f32` (its test); `half`:
    float16 ones through `e4m3_bits_to_f16`."""
    return _convert(codes, encode=False, half=half)

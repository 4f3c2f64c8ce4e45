"""W4A16 / W8A16 weights: int32 packing as compressed-tensors does it, and torch references.

Packing follows compressed-tensors `pack_to_int32`: signed values are offset to unsigned
(+2^(bits-1)) and element i of a row lands in word i // (32 / bits) at bit (i % (32 / bits)) *
bits (little-endian nibble order). `wna16_linear_ref` dequantizes and multiplies: the oracle
of the Triton kernel and the CPU fallback; `dequantize_packed_t` is the oracle of
`wna16_dequant`, and `large_m_threshold` the rule that sends large M through it and cuBLAS.
"""

from __future__ import annotations

import math
import os

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


def dequantize_packed_t(
    qweight_t: torch.Tensor,  # [ceil(K / f), N] int32, packed along K (the kernels' layout)
    scales_t: torch.Tensor,  # [groups, N]
    zeros_t: torch.Tensor | None,  # [groups, N] (2^(bits-1) + zero point), None when symmetric
    group_size: int,  # <= 0 or >= k: per output channel
    bits: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """Torch reference of `wna16_dequant`: the dense [N, K] weight from the kernels' inputs.

    Same arithmetic as `dequantize_weight` (which it calls): (u - zero) * scale in float32,
    then one cast to `dtype`. With u and zero small integers and a bf16 / fp16 scale the fp32
    product is exact, so the result is the correctly rounded (nearest-even) weight.
    """
    offset = 1 << (bits - 1)
    q = unpack_from_int32(qweight_t, bits, k, packed_dim=0).t()  # [N, K] signed codes
    zp = None if zeros_t is None else zeros_t.t().to(torch.float32) - offset
    group = k if group_size <= 0 or group_size >= k else group_size
    return dequantize_weight(q, scales_t.t(), zp, group, dtype=dtype).contiguous()


# ---------------------------------------------------------------- large-M rule
#
# (Layers in the tensor-core layout of `triton_w4a16_mma` do not use this rule: they run its GEMV
# up to M = 16 or 32 and its exact dequant + cuBLAS above; see `quantized_linear._mma_max_m`.)
#
# For M > 16 a W4A16 layer can run the Triton dequant-GEMM (`wna16_gemm`) or expand the weight
# into a dense scratch matrix (`wna16_dequant`, one bandwidth-bound pass) and hand it to cuBLAS.
# Measured on an H200 (Qwen2.5-7B shapes, group 128, µs; run of benchmarks/quant/
# bench_w4a16_gemm.py, tuned Triton configs):
#
#   layer (N x K)         M    bf16 cuBLAS   Triton GEMM   dequant (est.)   dequant + cuBLAS
#   gate_up 37888x3584    64       83            98             97               180
#   gate_up              128       83           158             97               180
#   gate_up              256      109           286             97               206
#   gate_up              512      213           520             97               310
#   down     3584x18944   32       49           149             48                97
#   down                 512      100           301             48               148
#   qkv      4608x3584    32       18            34             12                30
#   o        3584x3584    32       18            34              9                27
#
# "dequant (est.)" is (N*K*bits/8 read + N*K*2 written) / 3.5 TB/s. Two regimes decide:
#
# 1. The GEMM fills the GPU (gate_up): it runs at ~40% of cuBLAS's bf16 rate once M is
#    compute-bound (2*256*N*K flop in 286 µs = 243 TFLOP/s against cuBLAS's 640 at M = 256).
#    Per weight the dequant pass costs (bits/8 + 2) B / 3.5 TB/s, what the slower GEMM loses is
#    2*M flop * (1/243T - 1/640T): N*K cancels, and dequant + cuBLAS wins from
#    M = (bits/8 + 2) / (2 * 3.5e12 * (1/243e12 - 1/640e12)) = 140 for 4 bits (168 for 8);
#    the measured crossing on gate_up lies between 128 (180 vs 158) and 256 (206 vs 286).
# 2. The GEMM underfills the GPU: without split-K above M = 16 it has cdiv(N, 64) column tiles
#    (BLOCK_N = 64 in the tuned configs), each walking all of K. With fewer column tiles than
#    SMs (N < 64 * 132 = 8448 on an H200: qkv, o, down) it is 2-3x slower than cuBLAS at any
#    M up to 128 while the dequant pass costs about one bf16 GEMM read (2.5 vs 2 B per weight):
#    dequant + cuBLAS wins from the first M past the GEMV (17; M = 17..31 runs the GEMM's
#    M = 32 tiles at the M = 32 time). Above M ~ 140 rule 1 applies to these shapes too.
# Measured (H200 run 5, `benchmarks/results/w4a16_gemm_h200_run5.json`, µs, dequant + cuBLAS
# vs the tuned Triton GEMM): down 92 vs 149 (M=32), 141 vs 301 (512): rule 2 holds; gate_up
# 170 vs 158 (128), 189 vs 286 (256): rule 1 holds. But qkv and o_proj contradict rule 2: their
# dequant pass alone took 41 and 51 µs (1.0 and 0.6 TB/s, not the 3.5 assumed), so dequant +
# cuBLAS lost at every measured M (o_proj 143 vs 63 at M=512; qkv 93 vs 93 at M=512). Rule 2
# is therefore kept for long-K layers (K >= 2N, where the GEMM's few column tiles each walk a
# long K: down_proj) and for layers whose GEMM runs the untuned heuristic config, and the
# narrow layers with a measured (tuned) GEMM config switch at M = 1024 (compute-bound: at
# M=2048 o_proj's GEMM needs ~2.5x cuBLAS's ~85 µs, more than the 51 µs dequant pass). The
# untuned case is measured too: Qwen2.5-3B W4A16 (no 3B shapes in the tuned table) decoded
# batch 64 at 12,305 tok/s with dequant + cuBLAS on qkv/o (run 5) and 8,920 with the GEMM
# (run 6).

_DEQUANT_BW = 3.5e12  # B/s the dequant pass is assumed to reach (H200 HBM3e: 4.8 peak)
_TRITON_GEMM_FLOPS = 243e12  # Triton dequant-GEMM at M = 256 (gate_up), H200
_CUBLAS_BF16_FLOPS = 640e12  # cuBLAS bf16 at M = 256 (gate_up), H200
_GEMM_BLOCK_N = 64  # the tuned GEMM configs' column tile for M = 32 ... 256
_FIRST_M_PAST_GEMV = 17
_NARROW_SHORT_K_M = 1024  # qkv / o_proj-like layers (see above)


def large_m_threshold(
    n: int, k: int, bits: int = 4, num_sms: int = 132, gemm_tuned: bool = False
) -> int:
    """The smallest M from which dequant + cuBLAS beats the Triton GEMM (see the notes above);
    gemm_tuned: the GEMM has a measured config for this shape on this GPU."""
    bytes_per_weight = bits / 8 + 2
    compute_m = bytes_per_weight / (
        2 * _DEQUANT_BW * (1 / _TRITON_GEMM_FLOPS - 1 / _CUBLAS_BF16_FLOPS)
    )
    if -(-n // _GEMM_BLOCK_N) < num_sms:
        narrow_short_k = k < 2 * n and gemm_tuned
        return _NARROW_SHORT_K_M if narrow_short_k else _FIRST_M_PAST_GEMV
    return max(_FIRST_M_PAST_GEMV, math.ceil(compute_m))


def large_m_min(
    n: int, k: int, bits: int = 4, num_sms: int = 132, gemm_tuned: bool = False
) -> int | None:
    """`large_m_threshold`, or `PAGODA_W4A16_LARGE_M=<int>` when set (0: never; None returned).

    Read per call (layers cache the answer on their first forward, before graph capture).
    """
    env = os.environ.get("PAGODA_W4A16_LARGE_M", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"PAGODA_W4A16_LARGE_M={env!r}: use an integer (0 = never)") from None
        return value if value > 0 else None
    return large_m_threshold(n, k, bits, num_sms, gemm_tuned)

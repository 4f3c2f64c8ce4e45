"""W4A16 on tensor cores: int4 -> bf16x2 in registers, then `mma.sync` (GEMV, M <= 64); a
Triton GEMM on the same weight layout for M = 33-64 on the large layers.

Why: the FMA GEMV (`triton_w4a16.wna16_gemv`) spends a mask-and-OR, a float subtract and an FMA
per weight on the FP32 pipes and read int4 weights at ~44 % of the H200's copy bandwidth; its
cost also grows with M. Here, per 32-bit word (8 weights), 3 shifts and 4 `lop3` turn the
nibbles into four bf16x2 values 128 + u (the exponent of 128 makes the code the low mantissa
bits, exactly) and `mma.sync.m16n8k16` multiplies 16 weight columns x 16 K by 8 activation rows
into fp32; a second MMA with a constant A of -136 adds -136 * sum(x) to the same accumulator
(the code offset, exact in fp32, no subtract per weight); the group scale multiplies each
tile's partial (64 K) once per output. Measured on the H200 (Qwen2.5-7B shapes, M = 1): qkv 5.7,
o 5.3, gate_up 26.3, down 14.0-16.0 µs against the FMA GEMV's 9.2 / 7.8 / 34.4 / 20.4, and at
M = 8 nearly the M = 1 time (gate_up 31.5 vs 70.6); see BENCHMARKS.md.

Triton has no way to place a tensor in an MMA fragment, so the weights are repacked once at load
into the order in which the threads of a warp hold the MMA's A fragments, and the MMA is issued
from `tl.inline_asm_elementwise(pack=4)`: every thread runs the same asm on its own 4 words,
which is exactly the warp-wide collective `mma.sync` expects. That relies on how Triton lays out
a [rows, 128] int32 tile loaded contiguously along its last dimension (16 B per thread, 32
threads along the row, warps down the rows): lane l of a warp holds elements 4l ... 4l+3 of a
row. The sm_90 TTGIR shows that layout for every config used (Triton 3.9, compiled without a
GPU), the GPU tests check the results on Triton 3.6, and `mma_self_test` checks them once per
device before a model takes this path (a mismatch: the older layout and the FMA GEMV).

Layout (`repack_mma`): a tile is 16 output columns x 64 K = 128 int32 words; tiles are stored
[N / 16][K / 64] (K fastest), each as [lane 0..31][v 0..3] words. Lane = 4 g + c (the MMA's
groupID g and thread-in-group c); word v of lane (g, c) feeds the v-th MMA of the tile. In MMA
v, thread c's K slots 2c, 2c+1 hold real K 16c + 4v + {0, 1} and slots 2c+8, 2c+9 hold
16c + 4v + {2, 3}: a lane's activations for a tile are 32 contiguous bytes, and MMA v's two B
registers are adjacent in them. The word's 8 nibbles, low to high: (row g, kA), (row g+8, kA),
(row g, kB), (row g+8, kB), then the same for kA+1, kB+1 in the high half-word (kA = 16c + 4v,
kB = kA + 2, rows = tile columns). Shifting by 0, 4, 8, 12 and masking 0x000F000F gives the
fragments a0a1, a2a3, a4a5, a6a7. Scales (`repack_mma_scales`): one int32 per (column group,
scale group, g) holding the scales of columns g and g + 8, one 32-bit load per lane.

Kernel (`_w4_mma_gemv_kernel`): a program owns one column group and a K slice (split-K through
the serial workspace of `wna16_gemv`), walks it two steps per iteration with two register sets
ping-ponged so that one step's weights are in flight during the other's math, reads the
activations just in time (L1: every program of an SM reads the same x), and loads its first
weights before `gdc_wait` (PDL). M = 9-32 (`_w4_mma_gemv_shared_kernel`): one accumulator per
block of 8 activation rows and one asm per tile (`_shared_asm`) that dequantizes each word once
for every block, the offset by `fma.rn.bf16x2` (u - 8 exactly) instead of the constant-A MMA;
M = 33-64 as two such launches, though layers take `wna16_mma_gemm` (large layers) or
`wna16_mma_dequant` + cuBLAS there (`quantized_linear._mma_max_m` / `_mma_gemm_max_m`, from
the H200 measurements in BENCHMARKS.md). What still limits the M = 1 GEMV: the same loads
without the math (`dry=True`) reach 69-75 % of the copy bandwidth on gate_up / down and 36-43 %
on qkv / o, and the math brings that to ~60 % / ~30 %; a bulk L2 prefetch of each program's
slice (`PAGODA_W4A16_PF`, sm_90+) made even the loads-only kernel slower (session 6), so the
small layers' time is fixed costs (launch, first DRAM round trip, the split-K flush), not bytes
in flight. A kernel that only reads the same bytes (one-shot programs, 8 x 16-byte loads per
thread) takes 3.8 / 3.4 / 17.6 / 9.6 µs on qkv / o / gate_up / down against this GEMV's 5.6 /
5.3 / 25.7 / 16.1 (session 7). `gated=True` (M <= 8) applies the MLP's SwiGLU in the epilogue
(a program walks a gate and an up column group); it measured no faster than the GEMV followed
by the activation kernel, so layers use it only when asked (`PAGODA_W4A16_FUSED_SILU=1`).

The torch reference `mma_gemv_emulate` follows the PTX fragment rules step by step (the CPU tests
check the repacking against the dequantized matmul with it); under the Triton interpreter
`_tile_mma` computes the same tile product with reshapes, so the CPU tests run the kernel's
bookkeeping; `wna16_linear_ref` is the numerical oracle on the GPU.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.triton_w4a16 import _serial_workspace

TILE_N = 16  # output columns per tile (the MMA's M)
TILE_K = 64  # K per tile (four MMAs of K = 16)
MAX_M = 8  # activation rows per MMA (its N)
MAX_ROWS = 64  # rows per call
SHARED_ROWS = 32  # rows per launch of the shared-dequantization kernel (4 blocks of 8)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def mma_supported(n: int, k: int, group_size: int, bits: int, has_zero_point: bool) -> bool:
    """Shapes this kernel takes: 4-bit symmetric, N % 16 == 0, K % 64 == 0, group % 64 == 0."""
    if bits != 4 or has_zero_point or n % TILE_N or k % TILE_K:
        return False
    return group_size <= 0 or group_size >= k or group_size % TILE_K == 0


def repack_mma(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes u [N, K] (0..15, any integer dtype) -> the kernel's int32 words
    [N / 16 * K / 64 * 128] (layout in the module notes)."""
    n, k = codes.shape
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"repack_mma needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got {n}x{k}")
    u = codes.to(torch.int64) & 0xF
    # col = ng*16 + h*8 + g ; k = kb*64 + c*16 + v*4 + half*2 + e
    u = u.view(n // 16, 2, 8, k // 64, 4, 4, 2, 2)  # ng, h, g, kb, c, v, half, e
    u = u.permute(0, 3, 2, 4, 5, 7, 6, 1)  # ng, kb, g, c, v, e, half, h
    u = u.reshape(-1, 8)  # nibble i = 4e + 2half + h at bits 4i
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * 4
    words = (u << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def repack_mma_scales(scales_t: torch.Tensor) -> torch.Tensor:
    """Scales [groups, N] (bf16) -> int32 [N / 16, groups, 8]: word g of a (column group, scale
    group) holds the scales of the tile columns g (low half) and g + 8 (high half), the two
    columns MMA lane group g accumulates."""
    groups, n = scales_t.shape
    if scales_t.dtype != torch.bfloat16 or n % TILE_N:
        raise ValueError(
            f"repack_mma_scales takes bf16 [groups, N % 16 == 0], got {scales_t.dtype}"
        )
    s = scales_t.t().contiguous().view(n // 16, 2, 8, groups)  # ng, h, g, group
    s = s.permute(0, 3, 2, 1).contiguous()  # ng, group, g, h
    return s.view(torch.int32).view(n // 16, groups, 8).contiguous()


def unpack_mma_scales(scale_pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of `repack_mma_scales`: [groups, N] bf16."""
    ncg, groups, _ = scale_pairs.shape
    s = scale_pairs.contiguous().view(torch.bfloat16).view(ncg, groups, 8, 2)  # ng, group, g, h
    return s.permute(1, 0, 3, 2).reshape(groups, ncg * 16).contiguous()


def unpack_mma(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `repack_mma`: the codes [N, K] as uint8."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    u = (words.view(-1, 1) >> shifts) & 0xF  # [tiles*128, 8]
    u = u.view(n // 16, k // 64, 8, 4, 4, 2, 2, 2)  # ng, kb, g, c, v, e, half, h
    u = u.permute(0, 7, 2, 1, 3, 4, 6, 5)  # ng, h, g, kb, c, v, half, e
    return u.reshape(n, k).to(torch.uint8)


def mma_gemv_emulate(
    x: torch.Tensor,  # [M, K], M <= 8
    words: torch.Tensor,  # repack_mma output
    scales_t: torch.Tensor,  # [groups, N]
    n: int,
    group_size: int,
) -> torch.Tensor:  # [M, N] float32
    """What the kernel computes, written fragment by fragment (PTX ISA m16n8k16 .bf16 layouts):
    the CPU oracle of the repacking and of the lane / register bookkeeping."""
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"M <= {MAX_M}")
    kb_n = k // TILE_K
    group = k if group_size <= 0 or group_size >= k else group_size
    xb = torch.zeros(MAX_M, k, dtype=torch.float32)
    xb[:m] = x.float().cpu()
    w = words.cpu().view(n // 16, kb_n, 8, 4, 4)  # ng, kb, g, c, v
    out = torch.zeros(MAX_M, n, dtype=torch.float32)
    s = scales_t.float().cpu()
    shifts = torch.tensor([0, 4, 8, 12])
    for ng in range(n // 16):
        for kb in range(kb_n):
            d = torch.zeros(16, MAX_M)  # D[row][col]: tile column row, activation row col
            for v in range(4):
                a = torch.zeros(16, 16)  # A[row][k slot]
                b = torch.zeros(16, MAX_M)  # B[k slot][n]
                for g in range(8):
                    for c in range(4):
                        word = int(w[ng, kb, g, c, v]) & 0xFFFFFFFF
                        regs = [(word >> int(sh)) & 0x000F000F for sh in shifts]
                        # reg r: low half -> element 2r, high half -> 2r + 1 (a0..a7)
                        vals = []
                        for r in regs:
                            vals += [float((r & 0xF) - 8), float(((r >> 16) & 0xF) - 8)]
                        a[g, 2 * c], a[g, 2 * c + 1] = vals[0], vals[1]
                        a[g + 8, 2 * c], a[g + 8, 2 * c + 1] = vals[2], vals[3]
                        a[g, 2 * c + 8], a[g, 2 * c + 9] = vals[4], vals[5]
                        a[g + 8, 2 * c + 8], a[g + 8, 2 * c + 9] = vals[6], vals[7]
                        ka = kb * 64 + 16 * c + 4 * v
                        kb_ = ka + 2
                        b[2 * c, g], b[2 * c + 1, g] = xb[g, ka], xb[g, ka + 1]
                        b[2 * c + 8, g], b[2 * c + 9, g] = xb[g, kb_], xb[g, kb_ + 1]
                d += a @ b
            grp = kb * TILE_K // group
            cols = torch.arange(16) + ng * 16
            out[:, cols] += (d * s[grp, cols][:, None]).t()
    return out[:m]


# The per-thread asm (pack = 4: each operand is 4 consecutive elements of the thread's row):
# $4-$7 the 4 words (one per MMA v), $8-$11 and $12-$15 the lane's 8 int32 activation pairs
# (MMA v reads pairs 2v, 2v+1: registers already adjacent as `mma` wants them), $16 the scale
# pair (4 int8 elements = one register), $17-$20 the accumulators in, $0-$3 out:
# acc += scale * (the tile's MMAs, from zero). The weights enter the MMA as 128 + u (exact
# bf16); a second MMA per v with every A element -136 (exact) adds -136 * sum(x) into the same
# fp32 accumulator, so the tile sums x * (u - 8) without a subtract per weight.
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
_D = "{d0, d1, d2, d3}"
_ASM = (
    """
{
.reg .b32 a0, a1, a2, a3, t, off, d0, d1, d2, d3, slo, shi;
mov.b32 off, 0xC308C308;
mov.b32 d0, 0;
mov.b32 d1, 0;
mov.b32 d2, 0;
mov.b32 d3, 0;
"""
    + "".join(
        f"""
lop3.b32 a0, ${4 + v}, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 4;
lop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 8;
lop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 12;
lop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;
{_MMA} {_D}, {{a0, a1, a2, a3}}, {{${8 + 2 * v}, ${9 + 2 * v}}}, {_D};
{_MMA} {_D}, {{off, off, off, off}}, {{${8 + 2 * v}, ${9 + 2 * v}}}, {_D};
"""
        for v in range(4)
    )
    + """
shl.b32 slo, $16, 16;
and.b32 shi, $16, 0xFFFF0000;
fma.rn.f32 $0, d0, slo, $17;
fma.rn.f32 $1, d1, slo, $18;
fma.rn.f32 $2, d2, shi, $19;
fma.rn.f32 $3, d3, shi, $20;
}"""
)
_ASM = tl.constexpr(_ASM)
_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 17))


def _shared_asm(nbb: int) -> str:
    """`_ASM` for nbb blocks of 8 activation rows sharing one dequantization (M = 9-32): each
    word becomes its four bf16x2 fragments once, u - 8 exactly (lop3 gives 128 + u, then one
    `fma.rn.bf16x2` by 1 and -136: no offset MMA), and every block runs one MMA per fragment.
    Operands (pack = 4): $0.. the nbb accumulators out (4 each); then the 4 words, per block its
    x1 / x2 pairs (8), the scale pair (1), the nbb accumulators in (4 each)."""
    w = 4 * nbb
    x = w + 4
    sp = x + 8 * nbb
    a = sp + 1
    lines = [
        "{",
        ".reg .b32 q<16>;",
        f".reg .b32 d<{4 * nbb}>;",
        ".reg .b32 t, off, one, slo, shi;",
        "mov.b32 off, 0xC308C308;",  # bf16x2 (-136, -136)
        "mov.b32 one, 0x3F803F80;",  # bf16x2 (1, 1)
    ]
    lines += [f"mov.b32 d{i}, 0;" for i in range(4 * nbb)]
    for v in range(4):
        for sh in range(4):
            r = f"q{4 * v + sh}"
            if sh == 0:
                lines.append(f"lop3.b32 {r}, ${w + v}, 0x000F000F, 0x43004300, 0xEA;")
            else:
                lines.append(f"shr.u32 t, ${w + v}, {4 * sh};")
                lines.append(f"lop3.b32 {r}, t, 0x000F000F, 0x43004300, 0xEA;")
            lines.append(f"fma.rn.bf16x2 {r}, {r}, one, off;")
        frag = ", ".join(f"q{4 * v + i}" for i in range(4))
        for b in range(nbb):
            d = ", ".join(f"d{4 * b + i}" for i in range(4))
            p0 = x + 8 * b + 2 * v  # MMA v reads the block's pairs 2v, 2v + 1
            lines.append(f"{_MMA} {{{d}}}, {{{frag}}}, {{${p0}, ${p0 + 1}}}, {{{d}}};")
    lines += [f"shl.b32 slo, ${sp}, 16;", f"and.b32 shi, ${sp}, 0xFFFF0000;"]
    for b in range(nbb):
        for i in range(4):
            sc = "slo" if i < 2 else "shi"
            lines.append(f"fma.rn.f32 ${4 * b + i}, d{4 * b + i}, {sc}, ${a + 4 * b + i};")
    lines.append("}")
    return "\n".join(lines)


_ASM_S2 = tl.constexpr(_shared_asm(2))
_ASM_S4 = tl.constexpr(_shared_asm(4))
_CONS_S2 = tl.constexpr(",".join(["=r"] * 8 + ["r"] * (4 + 16 + 1 + 8)))
_CONS_S4 = tl.constexpr(",".join(["=r"] * 16 + ["r"] * (4 + 32 + 1 + 16)))

# One bulk L2 prefetch per program (thread 0 of the CTA; skipped when the size is <= 0): the
# TMA unit streams `$2` bytes at `$1` into the L2 and the thread does not wait for them, so the
# bytes in flight are not bounded by registers. The asm's output is unused; `is_pure=False`
# keeps it.
_PF_ASM = tl.constexpr(
    """{
.reg .pred p;
.reg .b32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
setp.gt.and.s32 p, $2, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
)


@triton.jit
def _l2_prefetch(ptr, nbytes, INTERPRET: tl.constexpr):
    """Fire-and-forget prefetch of `nbytes` (a multiple of 16, 16-byte aligned) into the L2."""
    if not INTERPRET:
        size = tl.zeros([], dtype=tl.int32) + nbytes  # a tensor even if nbytes is a constant
        tl.inline_asm_elementwise(
            _PF_ASM, "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _tile_mma(acc, words, x1, x2, sp, INTERPRET: tl.constexpr, DRY: tl.constexpr = False):
    """acc [R, 128] fp32 += scale * tile product, per thread: words / x1 / x2 [R, 128] int32,
    sp [R, 128] int8 (4 bytes per lane: the scale pair). Under the Triton interpreter (no PTX)
    the same arithmetic written with reshapes: the CPU tests run the kernel's bookkeeping."""
    if DRY:  # benchmark only: the same loads, no math (what the memory system alone gives)
        return acc + (words ^ x1 ^ x2 ^ sp.to(tl.int32)).to(tl.float32)
    elif INTERPRET:
        R: tl.constexpr = words.shape[0]
        sh = tl.arange(0, 8) * 4
        q = ((words[:, :, None] >> sh[None, None, :]) & 0xF).to(tl.float32) - 8.0  # [R,128,8]
        q = tl.reshape(q, [R, 8, 4, 4, 2, 2, 2])  # g, c, v, e, half, h
        w = tl.reshape(tl.permute(q, (0, 6, 1, 2, 3, 5, 4)), [R, 16, 64])  # (h g), (c v half e)
        xw = tl.join(x1, x2)  # [R, 128, 2]: pair p = 4 * which + v'
        xf = tl.join(
            (xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)
        )
        xf = tl.reshape(xf, [R, 8, 4, 4, 2, 2])  # n, c, v', which, e
        xf = tl.reshape(tl.permute(xf, (0, 2, 4, 3, 5, 1)), [R, 64, 8])  # (c which v' e), n
        d = tl.sum(w[:, :, :, None] * xf[:, None, :, :], axis=2)  # [R, 16, 8]
        d = tl.reshape(tl.permute(tl.reshape(d, [R, 2, 8, 4, 2]), (0, 2, 3, 1, 4)), [R, 128])
        # the scale pair: bytes of (s[g] | s[g + 8] << 16), element v's column is g + 8 (v // 2)
        b = tl.reshape(sp.to(tl.uint8).to(tl.int32), [R, 32, 4])
        pair = tl.sum(b << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # [R, 32]
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -65536).to(tl.float32, bitcast=True)
        sc = tl.join(tl.join(lo, hi), tl.join(lo, hi))  # [R, 32, which, t]: v = 2 which + t
        return acc + d * tl.reshape(sc, [R, 128])
    else:
        return tl.inline_asm_elementwise(
            _ASM,
            _CONSTRAINTS,
            [words, x1, x2, sp, acc.to(tl.int32, bitcast=True)],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        ).to(tl.float32, bitcast=True)


@triton.jit
def _load_w(ng, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT: tl.constexpr,
            GROUP_TILES: tl.constexpr):  # fmt: skip
    """Words and scale pairs [rows, 128] of step `pos` of column group ng (a scalar, or [rows,
    1] when rows come from several column groups: the gated kernel), r the K tile of each row:
    the HBM stream. No masks: the caller keeps pos valid and K tiles per step divide K / 64."""
    kb = pos * KT + r  # [KT, 1]
    words = tl.load(w_ptr + (ng * kb_total + kb) * 128 + j)
    if GROUP_TILES > 0:
        grp = kb // GROUP_TILES
    else:
        grp = kb * 0
    sp = tl.load(sp_ptr + ((ng * n_groups_s + grp) * 8 + j // 16) * 4 + j % 4)
    return words, sp


@triton.jit
def _step(acc, words, sp, pos, r, x_rows, KT: tl.constexpr, KR: tl.constexpr,
          NB: tl.constexpr, INTERPRET: tl.constexpr, DRY: tl.constexpr):  # fmt: skip
    """One step: the tile's words times NB blocks of 8 activation rows ([NB, KR, 128] acc; KR
    = KT rows, or 2 KT in the gated kernel, r the K tile of each row). The activations are
    read here, just in time (L1 / L2 hits: every program on an SM reads the same x), which
    keeps them out of the prefetched register sets."""
    kb = (pos * KT + r)[None, :, :]  # [1, KR, 1]
    x1 = tl.load(x_rows + kb * 32)
    x2 = tl.load(x_rows + kb * 32 + 4)
    w3 = tl.broadcast_to(words[None, :, :], [NB, KR, 128])
    s3 = tl.broadcast_to(sp[None, :, :], [NB, KR, 128])
    out = _tile_mma(tl.reshape(acc, [NB * KR, 128]), tl.reshape(w3, [NB * KR, 128]),
                    tl.reshape(x1, [NB * KR, 128]), tl.reshape(x2, [NB * KR, 128]),
                    tl.reshape(s3, [NB * KR, 128]), INTERPRET, DRY)  # fmt: skip
    return tl.reshape(out, [NB, KR, 128])


@triton.jit
def _gated_flush(gate, up, ng, col, m, okm, N, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
                 stride_om, HAS_BIAS: tl.constexpr, ONE_SPLIT: tl.constexpr):  # fmt: skip
    """Store silu(gate) * up (fp32 sums, bias added first) at column col of out [M, N / 2];
    with split-K the gate and up partials meet in the workspace (columns col and col + N / 2)
    and the last program of the column group applies the activation."""
    half = N // 2
    if not ONE_SPLIT:
        tl.atomic_add(ws_ptr + m * N + col, gate, mask=okm, sem="relaxed")
        tl.atomic_add(ws_ptr + m * N + half + col, up, mask=okm, sem="relaxed")
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + ng, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            g_bits = tl.atomic_xchg(wsi_ptr + m * N + col, tl.zeros_like(m), mask=okm,
                                    sem="relaxed")  # fmt: skip
            u_bits = tl.atomic_xchg(wsi_ptr + m * N + half + col, tl.zeros_like(m), mask=okm,
                                    sem="relaxed")  # fmt: skip
            _gated_store(g_bits.to(tl.float32, bitcast=True), u_bits.to(tl.float32, bitcast=True),
                         col, m, okm, half, b_ptr, out_ptr, stride_om, HAS_BIAS)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + ng, 0, sem="relaxed")
    else:
        _gated_store(gate, up, col, m, okm, half, b_ptr, out_ptr, stride_om, HAS_BIAS)


@triton.jit
def _gated_store(gate, up, col, m, okm, half, b_ptr, out_ptr, stride_om,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
    if HAS_BIAS:
        gate += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + half + col, mask=okm, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + m * stride_om + col, y.to(out_ptr.dtype.element_ty), mask=okm)


@triton.jit
def _w4_mma_gemv_kernel(
    x_ptr, w_ptr, sp_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, steps_per_split, n_groups_s,
    stride_xm, stride_om,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    KT: tl.constexpr,  # K tiles per step (rows of the [KT, 128] word tile), divides K / 64
    NB: tl.constexpr,  # blocks of 8 activation rows (M <= 8 NB)
    HAS_BIAS: tl.constexpr,
    ONE_SPLIT: tl.constexpr,  # no split-K: the workspace arguments are unused
    GATED: tl.constexpr,  # W = [gate; up] (N = 2 I): out [M, I] = silu(x gate^T) * (x up^T)
    INTERPRET: tl.constexpr,
    DRY: tl.constexpr,  # benchmarks: the loads without the math (wrong results)
    PF_FIRST: tl.constexpr,  # steps of the slice bulk-prefetched into the L2 before gdc_wait
    PF_LOOP: tl.constexpr,  # keep prefetching PF_FIRST steps ahead inside the loop
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (column group, K slice): walks its slice two steps per iteration with two
    register sets (A, B) ping-ponged: B's loads are issued before A's MMAs and A's next loads
    before B's MMAs, so each step's words and scales are in flight during the other step's
    math. (With one register set, ptxas orders the next loads after the MMAs that read the
    registers those loads overwrite: no overlap.) The first step's weights and scales are
    loaded before `gdc_wait`: they never depend on the previous kernel. One flush at the end:
    a plain store without split-K, else the self-cleaning serial reduction of `wna16_gemv`.

    GATED (the MLP's gate_up_proj): program ng also walks column group ng + I / 16, the up
    rows of the same columns, as KT more rows of its word tile; the MMA puts a column's gate
    and up sums in the same thread and register, so the epilogue stores silu(gate) * up and
    the activation kernel (one launch per layer) disappears."""
    ng = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb_total = K // 64
    steps_total = kb_total // KT
    s0 = pid_k * steps_per_split
    n_steps = tl.minimum(steps_per_split, steps_total - s0)
    KR: tl.constexpr = 2 * KT if GATED else KT  # rows of the word tile
    r = tl.arange(0, KR)[:, None]
    if GATED:
        ngr = ng + (r // KT) * (N // 32)  # rows KT..2KT-1: the up half's column group
        r = r % KT
    else:
        ngr = ng
    j = tl.arange(0, 128)[None, :]
    nb = tl.arange(0, NB)[:, None, None]
    j3 = j[None, :, :]
    # lane (g, c) feeds B column g: activation row 8 nb + g (rows past M read row M - 1: their
    # MMA columns are never stored)
    x_row = tl.minimum(8 * nb + j3 // 16, M - 1)
    x_rows = x_ptr + x_row * stride_xm + 8 * ((j3 // 4) % 4) + j3 % 4  # int32 pairs; + kb * 32
    pos = s0
    last = s0 + n_steps - 1
    step_bytes = KT * 512
    w_base = w_ptr + ng * kb_total * 128  # this column group's tiles: contiguous, K fastest
    if PF_FIRST > 0:
        # The slice's first PF_FIRST steps and the column group's scale pairs, before anything
        # else: with PDL this runs while the previous kernel still works (HBM otherwise idle).
        _l2_prefetch(w_base + s0 * KT * 128, tl.minimum(n_steps, PF_FIRST) * step_bytes,
                     INTERPRET)  # fmt: skip
        _l2_prefetch(sp_ptr + ng * n_groups_s * 32, n_groups_s * 32, INTERPRET)
    wa, spa = _load_w(ngr, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([NB, KR, 128], dtype=tl.float32)
    for i in range(0, n_steps, 2):
        if PF_LOOP:  # the two steps PF_FIRST ahead (those already issued: size <= 0, skipped)
            ahead = i + PF_FIRST
            _l2_prefetch(w_base + (s0 + ahead) * KT * 128,
                         tl.minimum(n_steps - ahead, 2) * step_bytes, INTERPRET)  # fmt: skip
        pos_b = tl.minimum(pos + 1, last)
        wb, spb = _load_w(ngr, pos_b, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
        acc = _step(acc, wa, spa, pos, r, x_rows, KT, KR, NB, INTERPRET, DRY)
        pos_a = tl.minimum(pos + 2, last)
        wa, spa = _load_w(ngr, pos_a, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
        if i + 1 < n_steps:
            acc = _step(acc, wb, spb, pos_b, r, x_rows, KT, KR, NB, INTERPRET, DRY)
        pos = pos_a
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    jj = tl.arange(0, 128)[None, :]
    vv = jj % 4
    col = ng * 16 + jj // 16 + 8 * (vv // 2)
    m = 8 * tl.arange(0, NB)[:, None] + 2 * ((jj // 4) % 4) + vv % 2
    okm = m < M
    if GATED:
        halves = tl.sum(tl.reshape(acc, [NB, 2, KT, 128]), axis=2)  # [NB, gate / up, 128]
        gate, up = tl.split(tl.permute(halves, (0, 2, 1)))
        _gated_flush(gate, up, ng, col, m, okm, N, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
                     stride_om, HAS_BIAS, ONE_SPLIT)  # fmt: skip
        return
    part = tl.sum(acc, axis=1)  # [NB, 128]
    if ONE_SPLIT:
        if HAS_BIAS:
            part += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + col, part.to(out_ptr.dtype.element_ty), mask=okm)
    else:
        # Every thread's partial is issued before one thread's acq_rel increment (the split-K
        # semaphore of `wna16_gemv`); the last program reads and re-zeroes in one atomic.
        tl.atomic_add(ws_ptr + m * N + col, part, mask=okm, sem="relaxed")
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + ng, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            bits = tl.atomic_xchg(wsi_ptr + m * N + col, tl.zeros_like(m), mask=okm, sem="relaxed")
            total = bits.to(tl.float32, bitcast=True)
            if HAS_BIAS:
                total += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=okm)
            tl.atomic_xchg(cnt_ptr + ng, 0, sem="relaxed")


# ------------------------------------------- M = 9-32: blocks of 8 rows share the dequantization


@triton.jit
def _x_rows(x_ptr, M, stride_xm, b: tl.constexpr, j):
    """Activation pointers [1, 128] of block b (rows 8b .. 8b + 7; rows >= M read row M - 1)."""
    row = tl.minimum(8 * b + j // 16, M - 1)
    return x_ptr + row * stride_xm + 8 * ((j // 4) % 4) + j % 4


@triton.jit
def _step_shared(acc0, acc1, acc2, acc3, words, sp, pos, r, xr0, xr1, xr2, xr3,
                 KT: tl.constexpr, NB: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One step of NB (2 or 4) blocks over the same words: one asm dequantizes each word once
    for all of them (`_shared_asm`); the interpreter runs `_tile_mma` per block."""
    kb = (pos * KT + r) * 32  # [KT, 1]
    x1_0 = tl.load(xr0 + kb)
    x2_0 = tl.load(xr0 + kb + 4)
    x1_1 = tl.load(xr1 + kb)
    x2_1 = tl.load(xr1 + kb + 4)
    if NB == 4:
        x1_2 = tl.load(xr2 + kb)
        x2_2 = tl.load(xr2 + kb + 4)
        x1_3 = tl.load(xr3 + kb)
        x2_3 = tl.load(xr3 + kb + 4)
    if INTERPRET:
        acc0 = _tile_mma(acc0, words, x1_0, x2_0, sp, INTERPRET)
        acc1 = _tile_mma(acc1, words, x1_1, x2_1, sp, INTERPRET)
        if NB == 4:
            acc2 = _tile_mma(acc2, words, x1_2, x2_2, sp, INTERPRET)
            acc3 = _tile_mma(acc3, words, x1_3, x2_3, sp, INTERPRET)
    elif NB == 2:
        o0, o1 = tl.inline_asm_elementwise(
            _ASM_S2, _CONS_S2,
            [words, x1_0, x2_0, x1_1, x2_1, sp,
             acc0.to(tl.int32, bitcast=True), acc1.to(tl.int32, bitcast=True)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
        acc0 = o0.to(tl.float32, bitcast=True)
        acc1 = o1.to(tl.float32, bitcast=True)
    else:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            _ASM_S4, _CONS_S4,
            [words, x1_0, x2_0, x1_1, x2_1, x1_2, x2_2, x1_3, x2_3, sp,
             acc0.to(tl.int32, bitcast=True), acc1.to(tl.int32, bitcast=True),
             acc2.to(tl.int32, bitcast=True), acc3.to(tl.int32, bitcast=True)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
        acc0 = o0.to(tl.float32, bitcast=True)
        acc1 = o1.to(tl.float32, bitcast=True)
        acc2 = o2.to(tl.float32, bitcast=True)
        acc3 = o3.to(tl.float32, bitcast=True)
    return acc0, acc1, acc2, acc3


@triton.jit
def _block_rows(b: tl.constexpr, ng):
    """(activation rows, output columns) [128] that an accumulator's elements hold for block b
    (the MMA's D fragment: element v of lane (g, c) is row 2c + v % 2, column g + 8 (v // 2))."""
    jj = tl.arange(0, 128)
    vv = jj % 4
    return 8 * b + 2 * ((jj // 4) % 4) + vv % 2, ng * 16 + jj // 16 + 8 * (vv // 2)


@triton.jit
def _store_block(acc, b: tl.constexpr, ng, M, N, b_ptr, out_ptr, ws_ptr, stride_om,
                 HAS_BIAS: tl.constexpr, ONE_SPLIT: tl.constexpr):  # fmt: skip
    part = tl.sum(acc, axis=0)
    m, col = _block_rows(b, ng)
    okm = m < M
    if ONE_SPLIT:
        if HAS_BIAS:
            part += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + col, part.to(out_ptr.dtype.element_ty), mask=okm)
    else:
        tl.atomic_add(ws_ptr + m * N + col, part, mask=okm, sem="relaxed")


@triton.jit
def _final_block(b: tl.constexpr, ng, M, N, b_ptr, out_ptr, wsi_ptr, stride_om,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
    """The last program of a column group: read and re-zero block b's sums, store them."""
    m, col = _block_rows(b, ng)
    okm = m < M
    bits = tl.atomic_xchg(wsi_ptr + m * N + col, tl.zeros_like(m), mask=okm, sem="relaxed")
    total = bits.to(tl.float32, bitcast=True)
    if HAS_BIAS:
        total += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=okm)


@triton.jit
def _w4_mma_gemv_shared_kernel(
    x_ptr, w_ptr, sp_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, steps_per_split, n_groups_s,
    stride_xm, stride_om,
    GROUP_TILES: tl.constexpr,
    KT: tl.constexpr,
    NB: tl.constexpr,  # 2 or 4 blocks of 8 rows, one dequantization for all
    HAS_BIAS: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """`_w4_mma_gemv_kernel` for M = 9-32 with one accumulator per block of 8 rows, so that
    one asm per tile dequantizes once for every block (the older kernel's blocks each
    re-dequantize: its time grows with M). Same grid, ping-pong, PDL and split-K flush."""
    ng = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb_total = K // 64
    steps_total = kb_total // KT
    s0 = pid_k * steps_per_split
    n_steps = tl.minimum(steps_per_split, steps_total - s0)
    r = tl.arange(0, KT)[:, None]
    j = tl.arange(0, 128)[None, :]
    xr0 = _x_rows(x_ptr, M, stride_xm, 0, j)
    xr1 = _x_rows(x_ptr, M, stride_xm, 1, j)
    xr2 = _x_rows(x_ptr, M, stride_xm, 2, j)
    xr3 = _x_rows(x_ptr, M, stride_xm, 3, j)
    pos = s0
    last = s0 + n_steps - 1
    wa, spa = _load_w(ng, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc0 = tl.zeros([KT, 128], dtype=tl.float32)
    acc1 = tl.zeros([KT, 128], dtype=tl.float32)
    acc2 = tl.zeros([KT, 128], dtype=tl.float32)
    acc3 = tl.zeros([KT, 128], dtype=tl.float32)
    for i in range(0, n_steps, 2):
        pos_b = tl.minimum(pos + 1, last)
        wb, spb = _load_w(ng, pos_b, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
        acc0, acc1, acc2, acc3 = _step_shared(
            acc0, acc1, acc2, acc3, wa, spa, pos, r, xr0, xr1, xr2, xr3, KT, NB, INTERPRET
        )
        pos_a = tl.minimum(pos + 2, last)
        wa, spa = _load_w(ng, pos_a, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, KT, GROUP_TILES)
        if i + 1 < n_steps:
            acc0, acc1, acc2, acc3 = _step_shared(
                acc0, acc1, acc2, acc3, wb, spb, pos_b, r, xr0, xr1, xr2, xr3, KT, NB, INTERPRET
            )
        pos = pos_a
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    _store_block(acc0, 0, ng, M, N, b_ptr, out_ptr, ws_ptr, stride_om, HAS_BIAS, ONE_SPLIT)
    _store_block(acc1, 1, ng, M, N, b_ptr, out_ptr, ws_ptr, stride_om, HAS_BIAS, ONE_SPLIT)
    if NB == 4:
        _store_block(acc2, 2, ng, M, N, b_ptr, out_ptr, ws_ptr, stride_om, HAS_BIAS, ONE_SPLIT)
        _store_block(acc3, 3, ng, M, N, b_ptr, out_ptr, ws_ptr, stride_om, HAS_BIAS, ONE_SPLIT)
    if not ONE_SPLIT:  # the serial split-K semaphore of `_w4_mma_gemv_kernel`
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + ng, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            _final_block(0, ng, M, N, b_ptr, out_ptr, wsi_ptr, stride_om, HAS_BIAS)
            _final_block(1, ng, M, N, b_ptr, out_ptr, wsi_ptr, stride_om, HAS_BIAS)
            if NB == 4:
                _final_block(2, ng, M, N, b_ptr, out_ptr, wsi_ptr, stride_om, HAS_BIAS)
                _final_block(3, ng, M, N, b_ptr, out_ptr, wsi_ptr, stride_om, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + ng, 0, sem="relaxed")


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MmaConfig = tuple[int, int, int]  # (K tiles per step (at most), split-K, num_warps)


def default_mma_config(m: int, n: int, k: int, num_sms: int = 132) -> MmaConfig:
    """(K tiles per step, split-K, warps) measured on the H200 (`benchmarks/quant/
    bench_w4a16_mma.py`, Qwen2.5-7B shapes): at M <= 8 one warp per program, split-K to ~16
    programs per SM where the column groups alone do not fill the GPU (qkv / o / down: 224-288
    groups; gate_up: 2,368, no split); at 9 <= M <= 16 (two blocks of 8 rows, twice the math
    per weight) fewer, two-warp programs."""
    groups = n // TILE_N
    split = max(1, min(8, round(16 * num_sms / groups)))
    if m <= MAX_M:
        if groups >= 8 * num_sms:
            return (2, 1, 1)
        return (4, split, 1 if k <= 8192 else 2)
    if groups >= 8 * num_sms:
        return (2, 2, 2)
    return (4 if k <= 8192 else 2, split if k > 8192 else max(1, split // 3), 2)


Prefetch = tuple[int, bool]  # (steps bulk-prefetched before gdc_wait, keep that distance in-loop)
_PF_ALL = 1 << 20  # "the whole slice"


def parse_prefetch(text: str) -> Prefetch:
    """`PAGODA_W4A16_PF`: "0" (off), "all" (each program's whole slice up front), "F" (the first F
    steps up front) or "F,loop" (and then F steps ahead inside the loop)."""
    parts = [p.strip().lower() for p in text.split(",")]
    try:
        first = _PF_ALL if parts[0] == "all" else int(parts[0])
    except ValueError:
        first = -1
    loop = parts[1:] == ["loop"]
    if first < 0 or (len(parts) > 1 and not loop) or len(parts) > 2 or (loop and first == 0):
        raise ValueError(
            f"PAGODA_W4A16_PF={text!r}: expected 0, all, F or F,loop (F = steps, an integer >= 0)"
        )
    return first, loop


def default_mma_prefetch(m: int, n: int, k: int, capability: tuple[int, int]) -> Prefetch:
    """L2 bulk prefetch (sm_90+: `cp.async.bulk.prefetch.L2`): off by default, because it
    measured slower in every setting (H200, session 6: gate_up 26.6 -> 25.7-32.2 µs, qkv 5.6 ->
    6.1-6.2, batch-1 decode 462 -> 430-458 tok/s); `PAGODA_W4A16_PF` turns it on."""
    env = os.environ.get("PAGODA_W4A16_PF")
    if capability < (9, 0) or env is None:
        return (0, False)
    return parse_prefetch(env)


def default_shared_config(m: int, n: int, k: int, num_sms: int = 132) -> MmaConfig:
    """(K tiles per step, split-K, warps) of the shared-dequantization kernel (M = 9-32),
    measured on the H200 (`bench_w4a16_mma.py --shared-only`, session 6 run 2, µs at M = 16 /
    32): gate_up (4, 1, 2) 43.2 / 67.0; down (2, 8, 2) 21.8 then (4, 3, 2) 42.9; qkv (4, 4, 2)
    10.3 then (4, 2, 2) 16.1; o (4, 4, 2) 10.0 then (4, 3, 2) 13.6."""
    groups = n // TILE_N
    if groups >= 8 * num_sms:
        return (4, 1, 2)
    if m <= 2 * MAX_M:
        return (2, 8, 2) if k > 8192 else (4, 4, 2)
    return (4, max(1, round(5 * num_sms / groups)), 2)


def default_gated_config(m: int, n: int, k: int, num_sms: int = 132) -> MmaConfig:
    """(K tiles per step of each half, split-K, warps) of the gated GEMV (gate_up_proj, M <= 8),
    measured on the H200 (`bench_w4a16_mma.py --gated-only`, session 7 run 2, Qwen2.5-7B
    gate_up, µs at M = 1 / 8): (2, 1, 2) 27.6 / 30.8, the best at every M, against the plain
    GEMV + SiLU-and-mul's 28.2 / 33.5; (1, 1, 1) 34.7 / 43.6 and (1, 1, 2) 32.2 / 40.2 were the
    worst. Few column groups: split-K as the plain kernel does."""
    groups = n // (2 * TILE_N)
    if groups >= 4 * num_sms:
        return (2, 1, 2)
    return (2, max(1, min(8, round(8 * num_sms / groups))), 2)


def _k_tiles_per_step(k: int, target: int) -> int:
    kb = k // TILE_K
    kt = 1
    while kt * 2 <= target and kb % (kt * 2) == 0:
        kt *= 2
    return kt


def wna16_mma_gemv(
    x: torch.Tensor,  # [M, K] bf16, M <= MAX_M * nb
    words: torch.Tensor,  # repack_mma output
    scale_pairs: torch.Tensor,  # repack_mma_scales output
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    config: MmaConfig | None = None,
    out_dtype: torch.dtype | None = None,
    dry: bool = False,  # benchmarks: the loads without the math (wrong results)
    prefetch: Prefetch | None = None,  # None: `default_mma_prefetch`
    shared: bool | None = None,  # M > 8: one dequantization for all blocks (None: if it works)
    gated: bool = False,  # W = [gate; up]: return silu(x gate^T) * (x up^T), [M, N / 2]
) -> torch.Tensor:  # [M, N] ([M, N / 2] gated)
    """y = x @ dequant(W).T (+ bias) for W stored by `repack_mma` (4-bit symmetric), M <= 64,
    in blocks of 8 rows. With `shared` (the default above M = 8 where `mma_shared_self_test`
    passes) up to 4 blocks share each dequantized fragment and M = 33-64 runs as two such
    launches; otherwise every block re-dequantizes (`_w4_mma_gemv_kernel`). `gated` (M <= 8,
    N / 2 % 16 == 0): the SwiGLU of the MLP in the GEMV's epilogue (`default_gated_config`)."""
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS or x.dtype != torch.bfloat16:
        raise ValueError(
            f"wna16_mma_gemv takes bf16 x with 1 <= M <= {MAX_ROWS}, got {x.dtype} M={m}"
        )
    if not mma_supported(n, k, group_size, 4, False):
        raise ValueError(f"wna16_mma_gemv: unsupported shape N={n} K={k} group={group_size}")
    if gated and (m > MAX_M or n % (2 * TILE_N) or dry):
        raise ValueError(
            f"wna16_mma_gemv(gated=True) takes M <= {MAX_M} and N % {2 * TILE_N} == 0, "
            f"got M={m} N={n}"
        )
    if shared is None:
        shared = m > MAX_M and _shared_enabled(x.device)
    shared = shared and m > MAX_M and not dry
    if shared and m > SHARED_ROWS:  # two launches of <= 32 rows (each reads the weights)
        out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
        for r0 in range(0, m, SHARED_ROWS):
            r1 = min(m, r0 + SHARED_ROWS)
            part = wna16_mma_gemv(
                x[r0:r1], words, scale_pairs, n, group_size, bias, config, out_dtype,
                shared=r1 - r0 > MAX_M,
            )  # fmt: skip
            out[r0:r1] = part
        return out
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
    default = default_shared_config if shared else default_mma_config
    if gated:
        default = default_gated_config
    kt_target, split, warps = config or default(m, n, k, num_sms)
    kt = _k_tiles_per_step(k, kt_target)
    warps = min(warps, 2 * kt if gated else kt)
    steps_total = (k // TILE_K) // kt
    per = -(-steps_total // split)
    split = -(-steps_total // per)
    nb = triton.next_power_of_2(-(-m // MAX_M))
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()
    xi = x.view(torch.int32)
    out = torch.empty((m, n // 2 if gated else n), device=x.device, dtype=out_dtype or x.dtype)
    ws, cnt = out.view(-1)[:0].float(), words
    if split > 1:
        bufs = _serial_workspace(x.device, m * n, n // TILE_N)
        if bufs is None:  # capturing with a workspace too small to grow: no split-K
            per, split = steps_total, 1
        else:
            ws, cnt = bufs
    if gated:
        prefetch = (0, False)  # the prefetch covers one column group's tiles
    if prefetch is None:
        cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else (0, 0)
        prefetch = default_mma_prefetch(m, n, k, cap)
    pf_first = min(prefetch[0], per)
    pf_loop = bool(prefetch[1]) and 0 < pf_first < per
    per_channel = group_size <= 0 or group_size >= k
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    if shared:
        _w4_mma_gemv_shared_kernel[(n // TILE_N, split)](
            xi, words, scale_pairs.view(torch.int8), bias if bias is not None else out, out,
            ws, ws.view(torch.int32), cnt,
            m, n, k, per, scale_pairs.shape[1],
            xi.stride(0), out.stride(0),
            GROUP_TILES=0 if per_channel else group_size // TILE_K,
            KT=kt,
            NB=2 if m <= 2 * MAX_M else 4,
            HAS_BIAS=bias is not None,
            ONE_SPLIT=split == 1,
            INTERPRET=_INTERPRET,
            num_warps=warps,
            **pdl_launch_args(x),
        )  # fmt: skip
        return out
    _w4_mma_gemv_kernel[(n // (2 * TILE_N) if gated else n // TILE_N, split)](
        xi, words, scale_pairs.view(torch.int8), bias if bias is not None else out, out,
        ws, ws.view(torch.int32), cnt,
        m, n, k, per, scale_pairs.shape[1],
        xi.stride(0), out.stride(0),
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        KT=kt,
        NB=nb,
        HAS_BIAS=bias is not None,
        ONE_SPLIT=split == 1,
        GATED=gated,
        INTERPRET=_INTERPRET,
        DRY=dry,
        PF_FIRST=pf_first,
        PF_LOOP=pf_loop,
        num_warps=warps,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out


def _shared_enabled(device: torch.device) -> bool:
    if os.environ.get("PAGODA_W4A16_MMA_SHARED", "1").lower() in ("0", "false", "off", "no"):
        return False
    if device.type != "cuda":
        return True  # the interpreter: the same bookkeeping, no PTX
    return mma_shared_self_test(device.index or 0)


@functools.cache
def mma_shared_self_test(device_index: int) -> bool:
    """Whether the shared-dequantization kernel (M = 9-32) gives the reference result here (a
    failure only turns it off: the older per-block kernel still runs those rows)."""
    return self_test_on(torch.device("cuda", device_index), shared=True)


@functools.cache
def mma_self_test(device_index: int) -> bool:
    """Whether the kernels give the reference result on this GPU with this Triton (run once per
    device before a model uses the layout: the layout trick depends on Triton's choice of
    register layout, which a future version could change)."""
    return self_test_on(torch.device("cuda", device_index))


def self_test_on(device: torch.device, shared: bool = False) -> bool:
    """`mma_self_test` (or, `shared`, `mma_shared_self_test`) on any device (the interpreter
    runs it on the CPU)."""
    g = torch.Generator().manual_seed(0)
    n, k, group = 32, 256, 128
    q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    x = torch.randn(27, k, generator=g).to(torch.bfloat16)
    w = (q.float() * scale.float().repeat_interleave(group, 1)).to(torch.bfloat16)
    ref = x.float() @ w.float().t()
    words = repack_mma(q.to(torch.int32) + 8).to(device)
    pairs = repack_mma_scales(scale.t().contiguous()).to(device)
    try:
        d = wna16_mma_dequant(words, pairs, n, k, group).cpu().float()
        ok = bool(((d - w.float()).abs() <= 2.0**-7 * w.float().abs()).all())  # <= 1 bf16 ulp
        cases = ((12, (2, 2, 1)), (27, (2, 1, 2))) if shared else ((1, None), (12, (2, 2, 1)))
        for m, config in cases:
            y = wna16_mma_gemv(
                x[:m].to(device), words, pairs, n, group, config=config, shared=shared
            ).cpu()
            ok = ok and (y.float() - ref[:m]).abs().max().item() <= 2e-2 * ref.abs().max().item()
    except Exception as e:  # noqa: BLE001 - any failure means: do not use this path
        ok, why = False, f"unavailable ({e!r})"
    else:
        why = "gave wrong results here"
    if not ok:
        what, instead = (
            ("shared-dequantization kernel (M = 9-32)", "one dequantization per block of 8 rows")
            if shared
            else ("tensor-core kernels", "the older layout")
        )
        warnings.warn(f"W4A16 {what} {why}; using {instead}", stacklevel=2)
    return ok


# ------------------------------------------------- M = 33-512: a Triton GEMM on the MMA layout


@triton.jit
def _mma_gemm_kernel(
    x_ptr, w_ptr, sp_ptr, b_ptr, out_ptr,
    M, N, K, n_groups_s, k_tiles_per_split,
    stride_xm, stride_om, stride_os,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    BLOCK_M: tl.constexpr,
    CG: tl.constexpr,  # column groups of 16 per program (BLOCK_N = 16 CG)
    T: tl.constexpr,  # K tiles of 64 per step (divides GROUP_TILES: one scale per column)
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # > 1: fp32 partials [SPLIT, M, N] summed by the caller
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """out = x @ dequant(W).T for `repack_mma` words: each step unpacks [CG, T] tiles to the
    integer codes u - 8 (exact in bf16), multiplies x by them with `tl.dot`, and scales the
    fp32 product once per column (a step never crosses a scale group). One weight read for all
    of M, against the dequant pass + cuBLAS's weight read, bf16 write and bf16 read."""
    BN: tl.constexpr = 16 * CG
    BK: tl.constexpr = 64 * T
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = N // BN
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows
    kb_total = K // 64
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ng0 = pid_n * CG
    cg = tl.arange(0, CG)[:, None, None]
    t = tl.arange(0, T)[None, :, None]
    j = tl.arange(0, 128)[None, None, :]
    w_rows = w_ptr + ((ng0 + cg) * kb_total + t) * 128 + j  # [CG, T, 128]; + kb0 * 128
    sh = tl.arange(0, 8) * 4
    g8 = tl.arange(0, 8)[None, :]
    s_rows = sp_ptr + (ng0 + tl.arange(0, CG)[:, None]) * n_groups_s * 8 + g8  # [CG, 8]
    offs_k = tl.arange(0, BK)
    kb_lo = pid_k * k_tiles_per_split
    kb_hi = tl.minimum(kb_lo + k_tiles_per_split, kb_total)
    acc = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, T):
        words = tl.load(w_rows + kb0 * 128)
        q = (((words[:, :, :, None] >> sh[None, None, None, :]) & 0xF) - 8).to(tl.int8)
        q = tl.reshape(q, [CG, T, 8, 4, 4, 2, 2, 2])  # cg, t, g, c, v, e, half, h
        w = tl.reshape(
            tl.permute(q, (0, 7, 2, 1, 3, 4, 6, 5)), [BN, BK]
        )  # (cg h g), (t c v half e)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kb0 * 64 + offs_k[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        if INTERPRET:  # numpy has no bf16: the interpreter multiplies in fp32 (same values)
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(x, tl.trans(w.to(tl.bfloat16)))  # exact integer weights
        if GROUP_TILES > 0:
            grp = kb0 // GROUP_TILES
        else:
            grp = 0
        pair = tl.load(s_rows + grp * 8)  # [CG, 8]: columns g (low half), g + 8 (high half)
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -65536).to(tl.float32, bitcast=True)
        scale = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BN])  # (cg h g)
        acc += part * scale[None, :]
    offs_n = ng0 * 16 + tl.arange(0, BN)
    mask = mask_m[:, None]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)


GemmMmaConfig = tuple[int, int, int, int, int, int]  # BLOCK_M, CG, T, split, warps, stages


def default_mma_gemm_config(m: int, n: int, k: int, num_sms: int = 132) -> GemmMmaConfig:
    """(BLOCK_M, column groups, K tiles per step, split-K, warps, stages), measured on the H200
    (`bench_w4a16_mma.py --gemm-only`, session 6 run 4, Qwen2.5-7B shapes): M <= 64, 4 column
    groups, split-K to ~2 programs per SM (gate_up 118.6 µs at M = 64, down 74.3); larger M,
    [128, 128] tiles on 8 warps (gate_up 218.9 / 641.1 µs at M = 128 / 512)."""
    if m > 64:
        return (128, 8, 2, 1, 8, 3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    programs = max(1, -(-n // (16 * 4)))
    split = max(1, min(4, round(2 * num_sms / programs))) if programs < num_sms else 1
    return (block_m, 4, 2, split, 4, 3)


def wna16_mma_gemm(
    x: torch.Tensor,  # [M, K] bf16
    words: torch.Tensor,
    scale_pairs: torch.Tensor,
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: GemmMmaConfig | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """y = x @ dequant(W).T (+ bias) for `repack_mma` weights at any M (`_mma_gemm_kernel`)."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or not mma_supported(n, k, group_size, 4, False):
        raise ValueError(
            f"wna16_mma_gemm takes bf16 x and a supported shape, got {x.dtype} N={n} K={k} "
            f"group={group_size}"
        )
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
    block_m, cg, t, split, warps, stages = config or default_mma_gemm_config(m, n, k, num_sms)
    groups = n // TILE_N
    while cg > 1 and groups % cg:
        cg //= 2
    per_channel = group_size <= 0 or group_size >= k
    group_tiles = 0 if per_channel else group_size // TILE_K
    kb_total = k // TILE_K
    limit = kb_total if per_channel else group_tiles
    t = _k_tiles_per_step(k, min(t, limit))
    while group_tiles and group_tiles % t:
        t //= 2
    per = -(-(kb_total // t) // split) * t
    split = -(-kb_total // per)
    if x.stride(1) != 1:
        x = x.contiguous()
    if split == 1:
        out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
        stride_os = 0
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
        stride_os = out.stride(0)
    grid = (triton.cdiv(m, block_m) * (groups // cg), split)
    _mma_gemm_kernel[grid](
        x, words, scale_pairs, bias if bias is not None else x, out,
        m, n, k, scale_pairs.shape[1], per,
        x.stride(0), out.stride(-2), stride_os,
        GROUP_TILES=group_tiles,
        BLOCK_M=block_m,
        CG=cg,
        T=t,
        GROUP_M=8,
        HAS_BIAS=bias is not None and split == 1,
        SPLIT=split,
        INTERPRET=_INTERPRET,
        num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(torch.bfloat16)


# ---------------------------------------------------------------- large M: dequantize, then cuBLAS


@triton.jit
def _mma_dequant_kernel(
    w_ptr, sp_ptr, out_ptr,
    K, n_groups_s, stride_on,
    T: tl.constexpr,  # K tiles per program (divides K / 64)
    GROUP_TILES: tl.constexpr,  # 0: one scale per column
):  # fmt: skip
    """The dense [16, T * 64] block of column group ng from T tiles of `repack_mma` words:
    (u - 8) * scale in fp32 (exact) rounded once to bf16, as `dequantize_weight` does."""
    ng = tl.program_id(0)
    tb = tl.program_id(1)
    kb_total = K // 64
    kb = tb * T + tl.arange(0, T)[:, None]  # [T, 1]
    j = tl.arange(0, 128)[None, :]
    words = tl.load(w_ptr + (ng * kb_total + kb) * 128 + j)  # [T, 128]
    sh = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> sh[None, None, :]) & 0xF).to(tl.float32) - 8.0  # [T, 128, 8]
    q = tl.reshape(q, [T, 8, 4, 4, 2, 2, 2])  # kb, g, c, v, e, half, h
    w = tl.reshape(tl.permute(q, (6, 1, 0, 2, 3, 5, 4)), [16, T * 64])  # (h g), (kb c v half e)
    if GROUP_TILES > 0:
        grp = kb // GROUP_TILES
    else:
        grp = kb * 0
    pair = tl.load(sp_ptr + (ng * n_groups_s + grp) * 8 + tl.arange(0, 8)[None, :])  # [T, 8]
    lo = (pair << 16).to(tl.float32, bitcast=True)  # column g
    hi = (pair & -65536).to(tl.float32, bitcast=True)  # column g + 8
    s = tl.reshape(tl.permute(tl.join(lo, hi), (2, 1, 0)), [16, T])  # (h g), kb
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [16, T, 64]), [16, T * 64])
    rows = ng * 16 + tl.arange(0, 16)[:, None]
    cols = tb * T * 64 + tl.arange(0, T * 64)[None, :]
    tl.store(out_ptr + rows * stride_on + cols, (w * s).to(out_ptr.dtype.element_ty))


def wna16_mma_dequant(
    words: torch.Tensor, scale_pairs: torch.Tensor, n: int, k: int, group_size: int
) -> torch.Tensor:  # [N, K] bf16
    """The dense weight of a `repack_mma` layer (one bandwidth-bound pass)."""
    t = _k_tiles_per_step(k, 8)
    out = torch.empty((n, k), device=words.device, dtype=torch.bfloat16)
    per_channel = group_size <= 0 or group_size >= k
    _mma_dequant_kernel[(n // TILE_N, (k // TILE_K) // t)](
        words, scale_pairs, out,
        k, scale_pairs.shape[1], out.stride(0),
        T=t,
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        num_warps=4,
    )  # fmt: skip
    return out

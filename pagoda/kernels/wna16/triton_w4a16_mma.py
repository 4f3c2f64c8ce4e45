"""W4A16 on tensor cores, one weight layout (`repack_mma`) for every M: a GEMV with the int4
-> bf16 conversion and `mma.sync` in inline asm (M <= 64), a Triton GEMM with the dequantization
in registers feeding `tl.dot` (larger M), and an exact dequantization pass (then cuBLAS).

GEMV: per 32-bit word (8 weights) 3 shifts and 4 `lop3` turn the nibbles into four bf16x2
values 128 + u (the exponent of 128 makes the code the low mantissa bits, exactly) and
`mma.sync.m16n8k16` multiplies 16 weight columns x 16 K by 8 activation rows into fp32; a second
MMA whose A holds -(128 + z) per column (z = 8 for symmetric weights, else the zero point of the
column's group) adds -(128 + z) * sum(x) to the same accumulator; the group scale multiplies each
tile's partial once per output. Triton cannot place a tensor in an MMA fragment, so the weights
are stored in the order in which the threads of a warp hold the MMA's A fragments and the MMA is
issued from `tl.inline_asm_elementwise(pack=4)`: every thread runs the same asm on its own 4
words, which is the warp-wide collective `mma.sync` expects. That relies on how Triton lays out
a [rows, 128] int32 tile loaded contiguously along its last dimension (lane l of a warp holds
elements 4l ... 4l+3 of a row); `mma_self_test` checks it once per device before a model takes
this layout.

Layout (`repack_mma`): a tile is 16 output columns x 64 K = 128 int32 words; tiles are stored
[N / 16][K / 64] (K fastest), each as [lane 0..31][v 0..3] words. Lane = 4 g + c (the MMA's
groupID g and thread-in-group c); word v of lane (g, c) feeds the v-th MMA of the tile. In MMA
v, thread c's K slots 2c, 2c+1 hold real K 16c + 4v + {0, 1} and slots 2c+8, 2c+9 hold
16c + 4v + {2, 3}. The word's 8 nibbles, low to high: (row g, kA), (row g+8, kA), (row g, kB),
(row g+8, kB), then the same for kA+1, kB+1 in the high half-word (kA = 16c + 4v, kB = kA + 2,
rows = tile columns). Scales (`repack_mma_scales`) and zero offsets (`repack_mma_zeros`, bf16
-(128 + z)): one int32 per (column group, scale group, g) holding the values of columns g and
g + 8, one 32-bit load per lane.

GEMV kernels: a program owns one column group and a K slice (split-K through the serial
workspace), walks it two steps per iteration with two register sets ping-ponged, and loads its
first weights before `gdc_wait` (PDL). M = 9-32 (`_w4_mma_gemv_shared_kernel`): one asm per tile
dequantizes each word once for every block of 8 rows (the offset by `fma.rn.bf16x2`).
GEMM (`_mma_gemm_kernel`): the nibbles h, 2 + h, 4 + h, 6 + h of a word are column 8h + g at K
offsets 0, 2, 1, 3 of the lane's 4, so words loaded as [columns, K / 4] unpack into two weight
tiles (one per column half) whose K order is natural once interleaved: no permute.

`mma_gemv_emulate` follows the PTX fragment rules step by step (the CPU oracle of the
repacking); under the Triton interpreter the asm is replaced by the same arithmetic written with
reshapes, so the CPU tests run the kernels' bookkeeping.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from pagoda import envs, platform
from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.workspace import SplitKWorkspace

TILE_N = 16  # output columns per tile (the MMA's M)
TILE_K = 64  # K per tile (four MMAs of K = 16)
MAX_M = 8  # activation rows per MMA (its N)
MAX_ROWS = 64  # rows per call
SHARED_ROWS = 32  # rows per launch of the shared-dequantization kernel (4 blocks of 8)
_INTERPRET = envs.triton_interpret()


def mma_supported(n: int, k: int, group_size: int, bits: int, has_zero_point: bool) -> bool:
    """Shapes these kernels take: 4-bit (zero points or not), N % 16 == 0, K % 64 == 0, groups
    of a multiple of 64 (or one per column)."""
    del has_zero_point  # every kernel here takes zero pairs
    if bits != 4 or n % TILE_N or k % TILE_K:
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


def repack_mma_zeros(zeros_t: torch.Tensor) -> torch.Tensor:
    """Unsigned zero codes z [groups, N] (0..15, W = (u - z) * s) -> the kernels' zero pairs,
    laid out as `repack_mma_scales`: bf16 -(128 + z) (exact), the offset that turns the MMA's
    128 + u into u - z."""
    z = zeros_t.to(torch.float32)
    if bool(((z < 0) | (z > 15) | (z != z.round())).any()):
        raise ValueError("repack_mma_zeros takes integer zero codes in 0..15")
    return repack_mma_scales((-(z + 128.0)).to(torch.bfloat16))


def unpack_mma_zeros(zero_pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of `repack_mma_zeros`: [groups, N] int16 zero codes."""
    return (-unpack_mma_scales(zero_pairs).float() - 128.0).round().to(torch.int16)


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
# pair (4 int8 elements = one register), with zero points $17 the zero pair, then the 4
# accumulators in; $0-$3 out: acc += scale * (the tile's MMAs, from zero). The weights enter
# the MMA as 128 + u (exact bf16); a second MMA per v whose A holds -(128 + z) for each row
# (z = 8 without zero points: the constant -136; both exact) adds -(128 + z) * sum(x) into the
# same fp32 accumulator, so the tile sums x * (u - z) without a subtract per weight.
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
_D = "{d0, d1, d2, d3}"


def _zero_regs(zp: int | None) -> list[str]:
    """PTX setting `zlo` / `zhi` to the bf16x2 offsets of rows g / g + 8: the zero pair's low
    / high half twice (operand $zp), or -136 for both without zero points."""
    if zp is None:
        return ["mov.b32 zlo, 0xC308C308;", "mov.b32 zhi, 0xC308C308;"]
    return [f"prmt.b32 zlo, ${zp}, ${zp}, 0x1010;", f"prmt.b32 zhi, ${zp}, ${zp}, 0x3232;"]


def _gemv_asm(has_zp: bool) -> str:
    acc = 18 if has_zp else 17
    lines = [
        "{",
        ".reg .b32 a0, a1, a2, a3, t, zlo, zhi, d0, d1, d2, d3, slo, shi;",
        *_zero_regs(17 if has_zp else None),
        *[f"mov.b32 d{i}, 0;" for i in range(4)],
    ]
    for v in range(4):
        lines.append(f"lop3.b32 a0, ${4 + v}, 0x000F000F, 0x43004300, 0xEA;")
        for sh in range(1, 4):
            lines.append(f"shr.u32 t, ${4 + v}, {4 * sh};")
            lines.append(f"lop3.b32 a{sh}, t, 0x000F000F, 0x43004300, 0xEA;")
        b = f"{{${8 + 2 * v}, ${9 + 2 * v}}}"
        lines.append(f"{_MMA} {_D}, {{a0, a1, a2, a3}}, {b}, {_D};")
        lines.append(f"{_MMA} {_D}, {{zlo, zhi, zlo, zhi}}, {b}, {_D};")
    lines += ["shl.b32 slo, $16, 16;", "and.b32 shi, $16, 0xFFFF0000;"]
    for i in range(4):
        lines.append(f"fma.rn.f32 ${i}, d{i}, {'slo' if i < 2 else 'shi'}, ${acc + i};")
    lines.append("}")
    return "\n".join(lines)


_ASM = tl.constexpr(_gemv_asm(False))
_ASM_Z = tl.constexpr(_gemv_asm(True))
_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 17))
_CONSTRAINTS_Z = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 18))


def _shared_asm(nbb: int, has_zp: bool = False) -> str:
    """`_ASM` for nbb blocks of 8 activation rows sharing one dequantization (M = 9-32): each
    word becomes its four bf16x2 fragments once, u - z exactly (lop3 gives 128 + u, then one
    `fma.rn.bf16x2` by 1 and -(128 + z): no offset MMA), and every block runs one MMA per
    fragment. Operands (pack = 4): $0.. the nbb accumulators out (4 each); then the 4 words,
    per block its x1 / x2 pairs (8), the scale pair (1), the zero pair (1, has_zp), the nbb
    accumulators in (4 each)."""
    w = 4 * nbb
    x = w + 4
    sp = x + 8 * nbb
    a = sp + (2 if has_zp else 1)
    lines = [
        "{",
        ".reg .b32 q<16>;",
        f".reg .b32 d<{4 * nbb}>;",
        ".reg .b32 t, zlo, zhi, one, slo, shi;",
        *_zero_regs(sp + 1 if has_zp else None),
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
            # fragments a0a1 / a4a5 hold row g, a2a3 / a6a7 row g + 8
            lines.append(f"fma.rn.bf16x2 {r}, {r}, one, {'zhi' if sh % 2 else 'zlo'};")
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


def _shared_constraints(nbb: int, has_zp: bool) -> str:
    return ",".join(["=r"] * (4 * nbb) + ["r"] * (4 + 8 * nbb + 1 + has_zp + 4 * nbb))


_ASM_S2 = tl.constexpr(_shared_asm(2))
_ASM_S4 = tl.constexpr(_shared_asm(4))
_ASM_S2Z = tl.constexpr(_shared_asm(2, True))
_ASM_S4Z = tl.constexpr(_shared_asm(4, True))
_CONS_S2 = tl.constexpr(_shared_constraints(2, False))
_CONS_S4 = tl.constexpr(_shared_constraints(4, False))
_CONS_S2Z = tl.constexpr(_shared_constraints(2, True))
_CONS_S4Z = tl.constexpr(_shared_constraints(4, True))


@triton.jit
def _lane_pairs(pairs, R: tl.constexpr):
    """The bf16 pair (column g: low half, column g + 8: high half) of each lane, as fp32 [R, 32],
    from its 4 bytes [R, 128] (the interpreter's decoding of scale or zero pairs)."""
    b = tl.reshape(pairs.to(tl.uint8).to(tl.int32), [R, 32, 4])
    pair = tl.sum(b << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # [R, 32]
    return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _tile_mma(acc, words, x1, x2, sp, zp, INTERPRET: tl.constexpr, HAS_ZP: tl.constexpr):
    """acc [R, 128] fp32 += scale * tile product, per thread: words / x1 / x2 [R, 128] int32,
    sp (and, HAS_ZP, zp) [R, 128] int8 (4 bytes per lane: the scale / zero pair). Under the
    Triton interpreter (no PTX) the same arithmetic written with reshapes: the CPU tests run
    the kernel's bookkeeping."""
    if INTERPRET:
        R: tl.constexpr = words.shape[0]
        sh = tl.arange(0, 8) * 4
        q = ((words[:, :, None] >> sh[None, None, :]) & 0xF).to(tl.float32)  # [R, 128, 8]
        q = tl.reshape(q, [R, 8, 4, 4, 2, 2, 2])  # g, c, v, e, half, h
        w = tl.reshape(tl.permute(q, (0, 6, 1, 2, 3, 5, 4)), [R, 16, 64])  # (h g), (c v half e)
        if HAS_ZP:  # the pair holds -(128 + z): w = u - z
            zlo, zhi = _lane_pairs(zp, R)
            zlo = tl.max(tl.reshape(zlo, [R, 8, 4]), axis=2)  # the 4 lanes of g agree
            zhi = tl.max(tl.reshape(zhi, [R, 8, 4]), axis=2)
            zcol = tl.reshape(tl.permute(tl.join(zlo, zhi), (0, 2, 1)), [R, 16])  # (h g)
            w = w + 128.0 + zcol[:, :, None]
        else:
            w = w - 8.0
        xw = tl.join(x1, x2)  # [R, 128, 2]: pair p = 4 * which + v'
        xf = tl.join(
            (xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)
        )
        xf = tl.reshape(xf, [R, 8, 4, 4, 2, 2])  # n, c, v', which, e
        xf = tl.reshape(tl.permute(xf, (0, 2, 4, 3, 5, 1)), [R, 64, 8])  # (c which v' e), n
        d = tl.sum(w[:, :, :, None] * xf[:, None, :, :], axis=2)  # [R, 16, 8]
        d = tl.reshape(tl.permute(tl.reshape(d, [R, 2, 8, 4, 2]), (0, 2, 3, 1, 4)), [R, 128])
        # element v of a lane is column g + 8 (v // 2): the low or the high half of its pair
        lo, hi = _lane_pairs(sp, R)
        sc = tl.join(tl.join(lo, hi), tl.join(lo, hi))  # [R, 32, which, t]: v = 2 which + t
        return acc + d * tl.reshape(sc, [R, 128])
    elif HAS_ZP:
        return tl.inline_asm_elementwise(
            _ASM_Z,
            _CONSTRAINTS_Z,
            [words, x1, x2, sp, zp, acc.to(tl.int32, bitcast=True)],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        ).to(tl.float32, bitcast=True)
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
def _load_w(ng, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr, KT: tl.constexpr,
            GROUP_TILES: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """Words, scale pairs and (HAS_ZP) zero pairs [KT, 128] of step `pos` of column group ng, r
    the K tile of each row: the HBM stream. No masks: the caller keeps pos valid and K tiles
    per step divide K / 64. Without zero points the scale pairs stand in for them (unused)."""
    return load_tiles(ng, pos * KT + r, kb_total, n_groups_s, j, w_ptr, sp_ptr, zp_ptr,
                      GROUP_TILES, HAS_ZP)  # fmt: skip


@triton.jit
def load_tiles(ng, kb, kb_total, n_groups_s, j, w_ptr, sp_ptr, zp_ptr,
               GROUP_TILES: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """Words, scale pairs and (HAS_ZP) zero pairs [rows, 128] of K tile kb of column group ng
    (each a scalar or a [rows, 1] column; j = arange(128)[None, :]). Without zero points the
    scale pairs stand in for them (unused)."""
    words = tl.load(w_ptr + (ng * kb_total + kb) * 128 + j)
    if GROUP_TILES > 0:
        grp = kb // GROUP_TILES
    else:
        grp = kb * 0
    pair_off = ((ng * n_groups_s + grp) * 8 + j // 16) * 4 + j % 4
    sp = tl.load(sp_ptr + pair_off)
    if HAS_ZP:
        zp = tl.load(zp_ptr + pair_off)
    else:
        zp = sp
    return words, sp, zp


@triton.jit
def _step(acc, words, sp, zp, pos, r, x_rows, KT: tl.constexpr, NB: tl.constexpr,
          INTERPRET: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """One step: the tile's words times NB blocks of 8 activation rows ([NB, KT, 128] acc). The
    activations are read here, just in time (L1 / L2 hits: every program on an SM reads the
    same x), which keeps them out of the prefetched register sets."""
    kb = (pos * KT + r)[None, :, :]  # [1, KT, 1]
    x1 = tl.load(x_rows + kb * 32)
    x2 = tl.load(x_rows + kb * 32 + 4)
    w3 = tl.reshape(tl.broadcast_to(words[None, :, :], [NB, KT, 128]), [NB * KT, 128])
    s3 = tl.reshape(tl.broadcast_to(sp[None, :, :], [NB, KT, 128]), [NB * KT, 128])
    z3 = tl.reshape(tl.broadcast_to(zp[None, :, :], [NB, KT, 128]), [NB * KT, 128])
    out = _tile_mma(tl.reshape(acc, [NB * KT, 128]), w3, tl.reshape(x1, [NB * KT, 128]),
                    tl.reshape(x2, [NB * KT, 128]), s3, z3, INTERPRET, HAS_ZP)  # fmt: skip
    return tl.reshape(out, [NB, KT, 128])


@triton.jit
def _w4_mma_gemv_kernel(
    x_ptr, w_ptr, sp_ptr, zp_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, steps_per_split, n_groups_s,
    stride_xm, stride_om,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    KT: tl.constexpr,  # K tiles per step (rows of the [KT, 128] word tile), divides K / 64
    NB: tl.constexpr,  # blocks of 8 activation rows (M <= 8 NB)
    HAS_BIAS: tl.constexpr,
    HAS_ZP: tl.constexpr,  # zero pairs per (column, group); else the code offset 8
    ONE_SPLIT: tl.constexpr,  # no split-K: the workspace arguments are unused
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (column group, K slice): walks its slice two steps per iteration with two
    register sets (A, B) ping-ponged: B's loads are issued before A's MMAs and A's next loads
    before B's MMAs, so each step's words and scales are in flight during the other step's
    math (with one register set ptxas orders the next loads after the MMAs that read the
    registers those loads overwrite). The first step's weights are loaded before `gdc_wait`:
    they never depend on the previous kernel. One flush at the end: a plain store without
    split-K, else the self-cleaning serial reduction of `wna16_gemv`."""
    ng = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb_total = K // 64
    steps_total = kb_total // KT
    s0 = pid_k * steps_per_split
    n_steps = tl.minimum(steps_per_split, steps_total - s0)
    r = tl.arange(0, KT)[:, None]
    j = tl.arange(0, 128)[None, :]
    nb = tl.arange(0, NB)[:, None, None]
    j3 = j[None, :, :]
    # lane (g, c) feeds B column g: activation row 8 nb + g (rows past M read row M - 1: their
    # MMA columns are never stored)
    x_row = tl.minimum(8 * nb + j3 // 16, M - 1)
    x_rows = x_ptr + x_row * stride_xm + 8 * ((j3 // 4) % 4) + j3 % 4  # int32 pairs; + kb * 32
    pos = s0
    last = s0 + n_steps - 1
    wa, spa, zpa = _load_w(ng, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr, KT,
                           GROUP_TILES, HAS_ZP)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([NB, KT, 128], dtype=tl.float32)
    for i in range(0, n_steps, 2):
        pos_b = tl.minimum(pos + 1, last)
        wb, spb, zpb = _load_w(ng, pos_b, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr,
                               KT, GROUP_TILES, HAS_ZP)  # fmt: skip
        acc = _step(acc, wa, spa, zpa, pos, r, x_rows, KT, NB, INTERPRET, HAS_ZP)
        pos_a = tl.minimum(pos + 2, last)
        wa, spa, zpa = _load_w(ng, pos_a, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr,
                               KT, GROUP_TILES, HAS_ZP)  # fmt: skip
        if i + 1 < n_steps:
            acc = _step(acc, wb, spb, zpb, pos_b, r, x_rows, KT, NB, INTERPRET, HAS_ZP)
        pos = pos_a
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    jj = tl.arange(0, 128)[None, :]
    vv = jj % 4
    col = ng * 16 + jj // 16 + 8 * (vv // 2)
    m = 8 * tl.arange(0, NB)[:, None] + 2 * ((jj // 4) % 4) + vv % 2
    okm = m < M
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
def _step_shared(acc0, acc1, acc2, acc3, words, sp, zp, pos, r, xr0, xr1, xr2, xr3,
                 KT: tl.constexpr, NB: tl.constexpr, INTERPRET: tl.constexpr,
                 HAS_ZP: tl.constexpr):  # fmt: skip
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
        acc0 = _tile_mma(acc0, words, x1_0, x2_0, sp, zp, INTERPRET, HAS_ZP)
        acc1 = _tile_mma(acc1, words, x1_1, x2_1, sp, zp, INTERPRET, HAS_ZP)
        if NB == 4:
            acc2 = _tile_mma(acc2, words, x1_2, x2_2, sp, zp, INTERPRET, HAS_ZP)
            acc3 = _tile_mma(acc3, words, x1_3, x2_3, sp, zp, INTERPRET, HAS_ZP)
    elif NB == 2:
        if HAS_ZP:
            o0, o1 = tl.inline_asm_elementwise(
                _ASM_S2Z, _CONS_S2Z,
                [words, x1_0, x2_0, x1_1, x2_1, sp, zp,
                 acc0.to(tl.int32, bitcast=True), acc1.to(tl.int32, bitcast=True)],
                dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            o0, o1 = tl.inline_asm_elementwise(
                _ASM_S2, _CONS_S2,
                [words, x1_0, x2_0, x1_1, x2_1, sp,
                 acc0.to(tl.int32, bitcast=True), acc1.to(tl.int32, bitcast=True)],
                dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
            )  # fmt: skip
        acc0 = o0.to(tl.float32, bitcast=True)
        acc1 = o1.to(tl.float32, bitcast=True)
    else:
        if HAS_ZP:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _ASM_S4Z, _CONS_S4Z,
                [words, x1_0, x2_0, x1_1, x2_1, x1_2, x2_2, x1_3, x2_3, sp, zp,
                 acc0.to(tl.int32, bitcast=True), acc1.to(tl.int32, bitcast=True),
                 acc2.to(tl.int32, bitcast=True), acc3.to(tl.int32, bitcast=True)],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4,
            )  # fmt: skip
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
def _take_block(b: tl.constexpr, ng, M, N, wsi_ptr):
    """The last program of a column group: block b's sums, re-zeroed in the same exchange."""
    m, col = _block_rows(b, ng)
    okm = m < M
    bits = tl.atomic_xchg(wsi_ptr + m * N + col, tl.zeros_like(m), mask=okm, sem="relaxed")
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _put_block(total, b: tl.constexpr, ng, M, b_ptr, out_ptr, stride_om,
               HAS_BIAS: tl.constexpr):  # fmt: skip
    m, col = _block_rows(b, ng)
    okm = m < M
    if HAS_BIAS:
        total += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=okm)


@triton.jit
def _w4_mma_gemv_shared_kernel(
    x_ptr, w_ptr, sp_ptr, zp_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, steps_per_split, n_groups_s,
    stride_xm, stride_om,
    GROUP_TILES: tl.constexpr,
    KT: tl.constexpr,
    NB: tl.constexpr,  # 2 or 4 blocks of 8 rows, one dequantization for all
    HAS_BIAS: tl.constexpr,
    HAS_ZP: tl.constexpr,
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
    wa, spa, zpa = _load_w(ng, pos, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr, KT,
                           GROUP_TILES, HAS_ZP)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc0 = tl.zeros([KT, 128], dtype=tl.float32)
    acc1 = tl.zeros([KT, 128], dtype=tl.float32)
    acc2 = tl.zeros([KT, 128], dtype=tl.float32)
    acc3 = tl.zeros([KT, 128], dtype=tl.float32)
    for i in range(0, n_steps, 2):
        pos_b = tl.minimum(pos + 1, last)
        wb, spb, zpb = _load_w(ng, pos_b, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr,
                               KT, GROUP_TILES, HAS_ZP)  # fmt: skip
        acc0, acc1, acc2, acc3 = _step_shared(
            acc0,
            acc1,
            acc2,
            acc3,
            wa,
            spa,
            zpa,
            pos,
            r,
            xr0,
            xr1,
            xr2,
            xr3,
            KT,
            NB,
            INTERPRET,
            HAS_ZP,
        )
        pos_a = tl.minimum(pos + 2, last)
        wa, spa, zpa = _load_w(ng, pos_a, kb_total, n_groups_s, r, j, w_ptr, sp_ptr, zp_ptr,
                               KT, GROUP_TILES, HAS_ZP)  # fmt: skip
        if i + 1 < n_steps:
            acc0, acc1, acc2, acc3 = _step_shared(
                acc0,
                acc1,
                acc2,
                acc3,
                wb,
                spb,
                zpb,
                pos_b,
                r,
                xr0,
                xr1,
                xr2,
                xr3,
                KT,
                NB,
                INTERPRET,
                HAS_ZP,
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
            # every block's exchange before the first store: one round trip to the L2 (a store
            # between two exchanges would keep them in order)
            t0 = _take_block(0, ng, M, N, wsi_ptr)
            t1 = _take_block(1, ng, M, N, wsi_ptr)
            if NB == 4:
                t2 = _take_block(2, ng, M, N, wsi_ptr)
                t3 = _take_block(3, ng, M, N, wsi_ptr)
            _put_block(t0, 0, ng, M, b_ptr, out_ptr, stride_om, HAS_BIAS)
            _put_block(t1, 1, ng, M, b_ptr, out_ptr, stride_om, HAS_BIAS)
            if NB == 4:
                _put_block(t2, 2, ng, M, b_ptr, out_ptr, stride_om, HAS_BIAS)
                _put_block(t3, 3, ng, M, b_ptr, out_ptr, stride_om, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + ng, 0, sem="relaxed")


MmaConfig = tuple[int, int, int]  # (K tiles per step (at most), split-K, num_warps)


def default_mma_config(m: int, n: int, k: int, num_sms: int) -> MmaConfig:
    """(K tiles per step, split-K, warps) measured on the H200 (`benchmarks/quant/
    bench_w4a16_mma.py`, Qwen2.5-7B and 3B shapes): at M <= 8 one warp per program (two past
    K = 8192), split-K to ~16 programs per SM where the column groups alone do not fill the GPU
    (qkv / o / down: 128-288 groups; at M = 1 up to 16 slices, else 8), and at M = 1 a split
    of 2 where they fill it only 8-16 times (3B gate_up: 1,376 groups; none at M = 8, where
    both measured slower); at 9 <= M <= 16 (two blocks of 8 rows, twice the math per weight)
    fewer, two-warp programs."""
    groups = n // TILE_N
    split = max(1, min(16 if m == 1 else 8, round(16 * num_sms / groups)))
    if m <= MAX_M:
        if groups >= (16 if m == 1 else 8) * num_sms:
            return (2, 1, 1)
        if groups >= 8 * num_sms:
            return (2, 2, 1)
        return (4, split, 1 if k <= 8192 else 2)
    if groups >= 8 * num_sms:
        return (2, 2, 2)
    return (4 if k <= 8192 else 2, split if k > 8192 else max(1, split // 3), 2)


def default_shared_config(m: int, n: int, k: int, num_sms: int) -> MmaConfig:
    """(K tiles per step, split-K, warps) of the shared-dequantization kernel (M = 9-32), the
    best of an H200 sweep (`bench_w4a16_mma.py --shared-only`; the figures: BENCHMARKS.md,
    "Moved out"): one program a column group and K on gate_up-sized
    layers, split-K on the others, more splits at 16 rows than at 32."""
    groups = n // TILE_N
    if groups >= 8 * num_sms:
        return (4, 1, 2)
    if m <= 2 * MAX_M:
        return (2, 8, 2) if k > 8192 else (4, 4, 2)
    return (4, max(1, round(5 * num_sms / groups)), 2)


def _k_tiles_per_step(k: int, target: int) -> int:
    kb = k // TILE_K
    kt = 1
    while kt * 2 <= target and kb % (kt * 2) == 0:
        kt *= 2
    return kt


def wna16_mma_gemv(
    x: torch.Tensor,  # [M, K] bf16, M <= MAX_ROWS
    words: torch.Tensor,  # repack_mma output
    scale_pairs: torch.Tensor,  # repack_mma_scales output
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    config: MmaConfig | None = None,
    out_dtype: torch.dtype | None = None,
    shared: bool | None = None,  # M > 8: one dequantization for all blocks (None: if it works)
    zero_pairs: torch.Tensor | None = None,  # repack_mma_zeros output (asymmetric weights)
    workspace: SplitKWorkspace | None = None,  # split-K scratch (None: no split-K)
) -> torch.Tensor:  # [M, N]
    """y = x @ dequant(W).T (+ bias) for W stored by `repack_mma`, M <= 64, in blocks of 8
    rows; W = (u - z) * s with z = 8 (symmetric) or the zero pairs. With `shared` (the default
    above M = 8 where `mma_shared_self_test` passes) up to 4 blocks share each dequantized
    fragment and M = 33-64 runs as two such launches; otherwise every block re-dequantizes."""
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS or x.dtype != torch.bfloat16:
        raise ValueError(
            f"wna16_mma_gemv takes bf16 x with 1 <= M <= {MAX_ROWS}, got {x.dtype} M={m}"
        )
    if not mma_supported(n, k, group_size, 4, zero_pairs is not None):
        raise ValueError(f"wna16_mma_gemv: unsupported shape N={n} K={k} group={group_size}")
    if words.numel() * 8 != n * k:
        raise ValueError(
            f"wna16_mma_gemv: {words.numel()} weight words hold {words.numel() * 8} int4 "
            f"values, not N x K = {n} x {k}"
        )
    if shared is None:
        shared = m > MAX_M and _shared_enabled(x.device)
    shared = shared and m > MAX_M
    if shared and m > SHARED_ROWS:  # two launches of <= 32 rows (each reads the weights)
        out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
        for r0 in range(0, m, SHARED_ROWS):
            r1 = min(m, r0 + SHARED_ROWS)
            out[r0:r1] = wna16_mma_gemv(
                x[r0:r1], words, scale_pairs, n, group_size, bias, config, out_dtype,
                shared=r1 - r0 > MAX_M, zero_pairs=zero_pairs, workspace=workspace,
            )  # fmt: skip
        return out
    num_sms = platform.num_sms(x.device) if x.is_cuda else 4
    default = default_shared_config if shared else default_mma_config
    kt_target, split, warps = config or default(m, n, k, num_sms)
    kt = _k_tiles_per_step(k, kt_target)
    warps = min(warps, kt)
    steps_total = (k // TILE_K) // kt
    per = -(-steps_total // split)
    split = -(-steps_total // per)
    nb = triton.next_power_of_2(-(-m // MAX_M))
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()
    xi = x.view(torch.int32)
    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    ws, cnt = out.view(-1)[:0].float(), words
    if split > 1:
        bufs = workspace.buffers(x.device, m * n, n // TILE_N) if workspace is not None else None
        if bufs is None:  # no workspace, or capturing with one too small to grow: no split-K
            per, split = steps_total, 1
        else:
            ws, cnt = bufs
    per_channel = group_size <= 0 or group_size >= k
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    sp = scale_pairs.view(torch.int8)
    zp = zero_pairs.view(torch.int8) if zero_pairs is not None else sp
    kernel = _w4_mma_gemv_shared_kernel if shared else _w4_mma_gemv_kernel
    kernel[(n // TILE_N, split)](
        xi, words, sp, zp, bias if bias is not None else out, out,
        ws, ws.view(torch.int32), cnt,
        m, n, k, per, scale_pairs.shape[1],
        xi.stride(0), out.stride(0),
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        KT=kt,
        NB=(2 if m <= 2 * MAX_M else 4) if shared else nb,
        HAS_BIAS=bias is not None,
        HAS_ZP=zero_pairs is not None,
        ONE_SPLIT=split == 1,
        INTERPRET=_INTERPRET,
        num_warps=warps,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out


def _shared_enabled(device: torch.device) -> bool:
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
        workspace = SplitKWorkspace()  # the split-K configs above use its serial reduction
        for m, config in cases:
            y = wna16_mma_gemv(
                x[:m].to(device), words, pairs, n, group, config=config, shared=shared,
                workspace=workspace,
            ).cpu()  # fmt: skip
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


# ------------------------------------ M > 32: tensor-core GEMM with dequantization in registers


# The unpacking asm (pack = 2: two words per instance, $8 / $9): nibble i of both words as one
# bf16x2 register each ($0-$7), already (u - z) * s. prmt gathers the low / high half-words of
# the two words, so one shift + lop3 yields the nibble of both (128 + u, exact); fma by 1 and
# the zero pair's -(128 + z) gives u - z (exact), and fma by the scale with -0 adds one rounding
# (= the reference's fp32 product rounded to bf16). Nibble i belongs to column half h = i % 2:
# $10 / $11 the scales of halves 0 / 1, $12 / $13 their zero offsets (bf16x2 each).
def _unpack_asm() -> str:
    lines = [
        "{",
        ".reg .b32 lo, hi, t, one, nz;",
        "mov.b32 one, 0x3F803F80;",
        "mov.b32 nz, 0x80008000;",
        "prmt.b32 lo, $8, $9, 0x5410;",
        "prmt.b32 hi, $8, $9, 0x7632;",
    ]
    for i in range(8):
        src, sh = ("lo", 4 * i) if i < 4 else ("hi", 4 * (i - 4))
        if sh:
            lines.append(f"shr.u32 t, {src}, {sh};")
            lines.append(f"lop3.b32 ${i}, t, 0x000F000F, 0x43004300, 0xEA;")
        else:
            lines.append(f"lop3.b32 ${i}, {src}, 0x000F000F, 0x43004300, 0xEA;")
        lines.append(f"fma.rn.bf16x2 ${i}, ${i}, one, ${12 + i % 2};")
        lines.append(f"fma.rn.bf16x2 ${i}, ${i}, ${10 + i % 2}, nz;")
    lines.append("}")
    return "\n".join(lines)


_UNPACK_ASM = tl.constexpr(_unpack_asm())
_UNPACK_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 6))


@triton.jit
def _unpack8(words, s0, s1, z0, z1, INTERPRET: tl.constexpr):
    """The 8 nibbles of every word [R, C] as bf16 (u - z) * s (`_unpack_asm`); s0 / s1 and z0 /
    z1 (bf16 [R, C]) are the scales and zero offsets -(128 + z) of column halves 0 / 1."""
    if INTERPRET:  # fp32 (numpy has no bf16): the same values
        sf0 = s0.to(tl.float32)
        sf1 = s1.to(tl.float32)
        zf0 = z0.to(tl.float32) + 128.0
        zf1 = z1.to(tl.float32) + 128.0
        o0 = ((words & 0xF).to(tl.float32) + zf0) * sf0
        o1 = (((words >> 4) & 0xF).to(tl.float32) + zf1) * sf1
        o2 = (((words >> 8) & 0xF).to(tl.float32) + zf0) * sf0
        o3 = (((words >> 12) & 0xF).to(tl.float32) + zf1) * sf1
        o4 = (((words >> 16) & 0xF).to(tl.float32) + zf0) * sf0
        o5 = (((words >> 20) & 0xF).to(tl.float32) + zf1) * sf1
        o6 = (((words >> 24) & 0xF).to(tl.float32) + zf0) * sf0
        o7 = (((words >> 28) & 0xF).to(tl.float32) + zf1) * sf1
        return o0, o1, o2, o3, o4, o5, o6, o7
    else:
        return tl.inline_asm_elementwise(
            _UNPACK_ASM, _UNPACK_CONS, [words, s0, s1, z0, z1],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
        )  # fmt: skip


@triton.jit
def _pair_halves(pair, INTERPRET: tl.constexpr):
    """(low half, high half) of bf16 pairs held in int32: bf16 values (fp32 in the interpreter,
    whose numpy has no bf16)."""
    if INTERPRET:
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(
            tl.float32, bitcast=True
        )
    else:
        lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return lo, hi


@triton.jit
def _load_tc_step(w_rows, sp_ptr, zp_ptr, pair_rows, kb0, GROUP_TILES: tl.constexpr,
                  HAS_ZP: tl.constexpr):  # fmt: skip
    """Words [BR, T * 16] and the scale / zero pairs [BR] of the step at K tile kb0."""
    words = tl.load(w_rows + kb0 * 128)
    if GROUP_TILES > 0:
        grp = kb0 // GROUP_TILES
    else:
        grp = 0
    sp = tl.load(sp_ptr + pair_rows + grp * 8)
    if HAS_ZP:
        zp = tl.load(zp_ptr + pair_rows + grp * 8)
    else:
        zp = sp
    return words, sp, zp


@triton.jit
def _mma_gemm_kernel(
    x_ptr, w_ptr, sp_ptr, zp_ptr, b_ptr, out_ptr,
    M, N, K, n_groups_s, k_tiles_per_split,
    stride_xm, stride_om, stride_os,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    BLOCK_M: tl.constexpr,
    CG: tl.constexpr,  # column groups of 16 per program: two dots of CG * 8 columns each
    T: tl.constexpr,  # K tiles of 64 per step (divides GROUP_TILES: one scale per column)
    SWAP: tl.constexpr,  # out^T = W x^T (the weight is the dot's left operand)
    HAS_BIAS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    ONE_SPLIT: tl.constexpr,  # else fp32 partials [split, M, N] summed by the caller
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """out = x @ dequant(W).T for `repack_mma` words, without a permute: a tile's word at
    (lane 4g + c, v) holds, in nibbles h, 2 + h, 4 + h, 6 + h, column 8h + g at K offsets
    16c + 4v + (0, 2, 1, 3). So the words of CG column groups loaded as [CG * 8 (cg, g),
    T * 16 (t, c, v)] unpack (`_unpack8`) into two weight tiles, one per column half h, whose
    K order is the natural one once the 4 nibbles are interleaved (`tl.join`): two `tl.dot`s
    per step against the same activation tile, scales and zero points applied in the unpacking.
    Programs of the same column block are adjacent (pid % m-blocks): the weight is read from
    HBM once for all of M."""
    BR: tl.constexpr = 8 * CG  # rows of each half's weight tile
    BK: tl.constexpr = 64 * T
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    kb_total = K // 64
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ng0 = pid_n * CG
    rows = tl.arange(0, BR)  # (cg, g)
    cg = rows // 8
    g = rows % 8
    q = tl.arange(0, T * 16)  # (t, c, v)
    t = q // 16
    w_rows = w_ptr + (((ng0 + cg) * kb_total)[:, None] + t[None, :]) * 128
    w_rows += (16 * g)[:, None] + (q % 16)[None, :]  # [BR, T * 16]; + kb0 * 128
    pair_rows = (ng0 + cg) * n_groups_s * 8 + g  # [BR]; + grp * 8
    offs_k = tl.arange(0, BK)
    kb_lo = pid_k * k_tiles_per_split
    kb_hi = tl.minimum(kb_lo + k_tiles_per_split, kb_total)
    if SWAP:
        acc0 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_M, BR], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, BR], dtype=tl.float32)
    # The weight stream is prefetched one step ahead by hand (the loads of step i + 1 are
    # issued before step i's math): Triton's pipeliner only stages loads that feed a dot, and
    # these feed the unpacking asm.
    words, sp, zp = _load_tc_step(w_rows, sp_ptr, zp_ptr, pair_rows, kb_lo, GROUP_TILES, HAS_ZP)
    for kb0 in range(kb_lo, kb_hi, T):
        nxt = tl.minimum(kb0 + T, kb_hi - T)
        words_n, sp_n, zp_n = _load_tc_step(w_rows, sp_ptr, zp_ptr, pair_rows, nxt, GROUP_TILES,
                                            HAS_ZP)  # fmt: skip
        s0, s1 = _pair_halves(sp, INTERPRET)
        if HAS_ZP:
            z0, z1 = _pair_halves(zp, INTERPRET)
        else:
            z0 = tl.full([BR], -136.0, s0.dtype)
            z1 = z0
        shape: tl.constexpr = [BR, T * 16]
        o0, o1, o2, o3, o4, o5, o6, o7 = _unpack8(
            words,
            tl.broadcast_to(s0[:, None], shape),
            tl.broadcast_to(s1[:, None], shape),
            tl.broadcast_to(z0[:, None], shape),
            tl.broadcast_to(z1[:, None], shape),
            INTERPRET,
        )
        w0 = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o4, o6)), [BR, BK])
        w1 = tl.reshape(tl.join(tl.join(o1, o3), tl.join(o5, o7)), [BR, BK])
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kb0 * 64 + offs_k[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        if INTERPRET:
            x = x.to(tl.float32)
        if SWAP:
            xt = tl.trans(x)
            acc0 = tl.dot(w0, xt, acc0)
            acc1 = tl.dot(w1, xt, acc1)
        else:
            acc0 = tl.dot(x, tl.trans(w0), acc0)
            acc1 = tl.dot(x, tl.trans(w1), acc1)
        words, sp, zp = words_n, sp_n, zp_n
    if SWAP:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    col0 = (ng0 + cg) * 16 + g  # [BR]: half 0; half 1 is 8 columns on
    mask = mask_m[:, None]
    if ONE_SPLIT:
        if HAS_BIAS:
            acc0 += tl.load(b_ptr + col0).to(tl.float32)[None, :]
            acc1 += tl.load(b_ptr + col0 + 8).to(tl.float32)[None, :]
        ptrs = out_ptr + offs_m[:, None] * stride_om + col0[None, :]
        tl.store(ptrs, acc0.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(ptrs + 8, acc1.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + col0[None, :]
        tl.store(ptrs, acc0, mask=mask)
        tl.store(ptrs + 8, acc1, mask=mask)


GemmMmaConfig = tuple[int, int, int, int, int, int, bool]  # BM, CG, T, split, warps, stages, swap


def default_mma_gemm_config(m: int, n: int, k: int, num_sms: int) -> GemmMmaConfig:
    """(BLOCK_M, column groups, K tiles per step, split-K, warps, stages, swap-AB) from the H200
    sweep (`bench_w4a16_tc.py --sweep`, Qwen2.5-7B / 3B shapes, M = 16-256): [64 | 128, BN] tiles
    without swap-AB; 16 column groups on 8 warps for the narrow 7B layers (qkv, o, down), 8
    otherwise; split-K until the programs fill the SMs."""
    block_m = 64 if m <= 64 else 128
    cg = 16 if (n <= 8192 and k >= 3584) else 8
    warps = 8 if (cg == 16 or block_m == 128) else 4
    programs = -(-m // block_m) * max(1, n // (16 * cg))
    split = max(1, min(8, round(num_sms / programs))) if programs < num_sms else 1
    return (block_m, cg, 2, split, warps, 3, False)


def wna16_mma_gemm(
    x: torch.Tensor,  # [M, K] bf16
    words: torch.Tensor,
    scale_pairs: torch.Tensor,
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: GemmMmaConfig | None = None,
    zero_pairs: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """y = x @ dequant(W).T (+ bias) for `repack_mma` weights at any M (`_mma_gemm_kernel`)."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or not mma_supported(n, k, group_size, 4, False):
        raise ValueError(
            f"wna16_mma_gemm takes bf16 x and a supported shape, got {x.dtype} N={n} K={k} "
            f"group={group_size}"
        )
    num_sms = platform.num_sms(x.device) if x.is_cuda else 4
    block_m, cg, t, split, warps, stages, swap = config or default_mma_gemm_config(m, n, k, num_sms)
    groups = n // TILE_N
    while cg > 1 and groups % cg:
        cg //= 2
    per_channel = group_size <= 0 or group_size >= k
    group_tiles = 0 if per_channel else group_size // TILE_K
    kb_total = k // TILE_K
    t = _k_tiles_per_step(k, min(t, kb_total if per_channel else group_tiles))
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
        x, words, scale_pairs, zero_pairs if zero_pairs is not None else scale_pairs,
        bias if bias is not None else x, out,
        m, n, k, scale_pairs.shape[1], per,
        x.stride(0), out.stride(-2), stride_os,
        GROUP_TILES=group_tiles,
        BLOCK_M=block_m,
        CG=cg,
        T=t,
        SWAP=swap,
        HAS_BIAS=bias is not None and split == 1,
        HAS_ZP=zero_pairs is not None,
        ONE_SPLIT=split == 1,
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
def _per_column(pair, T: tl.constexpr):
    """Pairs [T, 8] (columns g, g + 8 of each tile row kb) -> fp32 [16 (h g), T * 64]."""
    lo = (pair << 16).to(tl.float32, bitcast=True)  # column g
    hi = (pair & -65536).to(tl.float32, bitcast=True)  # column g + 8
    v = tl.reshape(tl.permute(tl.join(lo, hi), (2, 1, 0)), [16, T])  # (h g), kb
    return tl.reshape(tl.broadcast_to(v[:, :, None], [16, T, 64]), [16, T * 64])


@triton.jit
def _mma_dequant_kernel(
    w_ptr, sp_ptr, zp_ptr, out_ptr,
    K, n_groups_s, stride_on,
    T: tl.constexpr,  # K tiles per program (divides K / 64)
    GROUP_TILES: tl.constexpr,  # 0: one scale per column
    HAS_ZP: tl.constexpr,
):  # fmt: skip
    """The dense [16, T * 64] block of column group ng from T tiles of `repack_mma` words:
    (u - z) * scale in fp32 (exact) rounded once to bf16, as `dequantize_weight` does."""
    ng = tl.program_id(0)
    tb = tl.program_id(1)
    kb_total = K // 64
    kb = tb * T + tl.arange(0, T)[:, None]  # [T, 1]
    j = tl.arange(0, 128)[None, :]
    words = tl.load(w_ptr + (ng * kb_total + kb) * 128 + j)  # [T, 128]
    sh = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> sh[None, None, :]) & 0xF).to(tl.float32)  # [T, 128, 8]
    q = tl.reshape(q, [T, 8, 4, 4, 2, 2, 2])  # kb, g, c, v, e, half, h
    w = tl.reshape(tl.permute(q, (6, 1, 0, 2, 3, 5, 4)), [16, T * 64])  # (h g), (kb c v half e)
    if GROUP_TILES > 0:
        grp = kb // GROUP_TILES
    else:
        grp = kb * 0
    pair_off = (ng * n_groups_s + grp) * 8 + tl.arange(0, 8)[None, :]  # [T, 8]
    s = _per_column(tl.load(sp_ptr + pair_off), T)
    if HAS_ZP:  # the pair holds -(128 + z)
        w = w + 128.0 + _per_column(tl.load(zp_ptr + pair_off), T)
    else:
        w = w - 8.0
    rows = ng * 16 + tl.arange(0, 16)[:, None]
    cols = tb * T * 64 + tl.arange(0, T * 64)[None, :]
    tl.store(out_ptr + rows * stride_on + cols, (w * s).to(out_ptr.dtype.element_ty))


def wna16_mma_dequant(
    words: torch.Tensor,
    scale_pairs: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    zero_pairs: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, K] bf16
    """The dense weight of a `repack_mma` layer (one bandwidth-bound pass)."""
    t = _k_tiles_per_step(k, 8)
    out = torch.empty((n, k), device=words.device, dtype=torch.bfloat16)
    per_channel = group_size <= 0 or group_size >= k
    _mma_dequant_kernel[(n // TILE_N, (k // TILE_K) // t)](
        words, scale_pairs, zero_pairs if zero_pairs is not None else scale_pairs, out,
        k, scale_pairs.shape[1], out.stride(0),
        T=t,
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        HAS_ZP=zero_pairs is not None,
        num_warps=4,
    )  # fmt: skip
    return out

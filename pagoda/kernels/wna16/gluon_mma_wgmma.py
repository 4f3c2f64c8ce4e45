"""W4A16 GEMM on Hopper `wgmma` that reads the tensor-core GEMV's weight layout (`repack_mma`).

One weight copy serves every M: the GEMV (`triton_w4a16_mma`) at small M and this kernel from
where it wins. Swap-AB: out^T [N, M] = W [N, K] x^T [K, M], so a warpgroup's 64 weight rows are
the MMA's M and the batch (8-256 rows) its N. Warp w of a warpgroup owns one 16-column group of
the layout; per K step of 64 each lane holds its 4 words (16 bytes, one per K = 16 MMA), which are
exactly its `mma.sync` A fragments, and wgmma's register A operand has the same per-warp
fragment. An inline-asm block turns a word into its four bf16x2 registers: `lop3` makes 128 + u
(the code in the low mantissa bits, exact), `add.rn.bf16x2` of -(128 + z) gives u - z (exact),
`mul.rn.bf16x2` by the scale rounds once: the same bf16 as the reference dequantization
((u - z) * s in fp32, rounded). 15 instructions per 8 weights.

The layout orders K inside a 64-K tile: MMA v, thread c holds real K 16 c + 4 v + {0, 1} in its
slots 2 c, 2 c + 1 and 16 c + 4 v + {2, 3} in slots 2 c + 8, 2 c + 9. So the activation tile,
wgmma's B operand in a 128-byte-swizzled shared tile, is staged either in that slot order
(cp.async of 4-byte K pairs, slot pair 8 v + 4 h + c <- real pair 8 c + 2 v + h; cheaper at
small tiles) or, with NATURAL_X, as it is in memory (16-byte copies) after each lane's words are
exchanged across its quad so that they match natural K (`_QUAD_T`; cheaper from 64-row tiles).

Pipeline, per program: a ring of NUM_STAGES shared-memory stages holding the program's words for
one K step and the activation tile [BLOCK_M, 64]; the words run NUM_STAGES - 1 steps ahead, the
activations NUM_STAGES - 2 (one stage is still read by the MMA in flight); the MMA is issued
asynchronously with one left in flight over the next step's dequantization; two steps a loop
trip (consecutive MMAs' A operands must be distinct registers for ptxas to keep one in flight).
Split-K adds fp32 partials into the runner's `SplitKWorkspace`; the last program of an output
tile stores it and re-zeroes what it used (one launch, CUDA-graph safe). SCALE_AHEAD loads each
step's scale (zero) pairs a loop trip early; STAGED passes the finished tile through the
activation ring as fp32 and stores / adds it in 16-row chunks of 4 contiguous columns a thread
(vector accesses, and an epilogue that does not set the register count).

sm_90 only. The CPU tests check both orders against the layout (`unpack_slots`) and compile the
kernel for sm_90; the GPU tests compare it with the dequantized matmul.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from pagoda import platform
from pagoda.kernels.workspace import SplitKWorkspace

BLOCK_N = 64  # weight rows per warpgroup (wgmma's M)
BLOCK_K = 64  # K per loop step (one tile of the layout)
MAX_BLOCK_M = 256  # the largest wgmma N
BLOCK_MS = (8, 16, 32, 64, 128, 256)

WgmmaConfig = tuple  # (BLOCK_M, warpgroups, split-K, stages[, natural K order[, scales ahead]])
SMEM_BYTES = 227 * 1024  # sm_90's shared memory per block


def slot_to_real_pair(s: int) -> int:
    """The activation K pair (within a 64-K tile) that shared-memory slot pair `s` holds."""
    v, h, c = s // 8, (s // 4) % 2, s % 4
    return 8 * c + 2 * v + h


def wgmma_supported(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel takes: whole warpgroup rows, whole K tiles, groups of whole tiles."""
    per_channel = group_size <= 0 or group_size >= k
    return n % BLOCK_N == 0 and k % BLOCK_K == 0 and (per_channel or group_size % BLOCK_K == 0)


@functools.cache
def gluon_available() -> bool:
    """Gluon with Hopper's warpgroup MMA importable (Triton >= 3.5)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


# Per word (pack = 2 over bf16 pairs: one 32-bit register each): $0-$3 out, the four bf16x2
# A registers (rows g / g + 8 alternating, slots 2c.. then 2c + 8..); $4 the word; $5 / $6 the
# scale of row g / g + 8 in both halves; $7 / $8 the zero offsets -(128 + z) likewise.
_DEQUANT = "\n".join(
    [
        "{",
        ".reg .b32 t, u<4>;",
        "lop3.b32 u0, $4, 0x000F000F, 0x43004300, 0xEA;",
        *[
            f"shr.u32 t, $4, {4 * i};\nlop3.b32 u{i}, t, 0x000F000F, 0x43004300, 0xEA;"
            for i in range(1, 4)
        ],
        *[
            f"add.rn.bf16x2 u{i}, u{i}, ${8 if i % 2 else 7};\n"
            f"mul.rn.bf16x2 ${i}, u{i}, ${6 if i % 2 else 5};"
            for i in range(4)
        ],
        "}",
    ]
)
# Natural K order (NATURAL_X): a lane's 4 words hold real K 16 c + 0..15 (rows g, g + 8), while
# natural slice V of lane c needs K 16 V + 2 c + {0, 1} and 16 V + 8 + 2 c + {0, 1}, which sit in
# lane V's words c // 2 and 2 + c // 2 (bytes c % 2 and 2 + c % 2). Each lane packs those four
# bytes for every receiver with one `prmt` (in the order whose nibble pairs the dequantization
# expects), then a 4 x 4 transpose across the quad (two butterfly `shfl` stages) hands lane c
# its word for slice V. $0-$3 out (slices 0-3), $4-$7 in (the lane's words v = 0-3).
_QUAD_T = "\n".join(
    [
        "{",
        ".reg .b32 m<4>, t0, t1, r0, r1, ln;",
        ".reg .pred p;",
        "prmt.b32 m0, $4, $6, 0x6240;",
        "prmt.b32 m1, $4, $6, 0x7351;",
        "prmt.b32 m2, $5, $7, 0x6240;",
        "prmt.b32 m3, $5, $7, 0x7351;",
        "mov.u32 ln, %laneid;",
        *[
            line
            for bit, (a, b, c, d) in ((1, (0, 1, 2, 3)), (2, (0, 2, 1, 3)))
            for line in (
                f"and.b32 t0, ln, {bit};",
                "setp.ne.u32 p, t0, 0;",
                f"selp.b32 t0, m{a}, m{b}, p;",
                f"selp.b32 t1, m{c}, m{d}, p;",
                f"shfl.sync.bfly.b32 r0, t0, {bit}, 0x1f, 0xffffffff;",
                f"shfl.sync.bfly.b32 r1, t1, {bit}, 0x1f, 0xffffffff;",
                f"selp.b32 m{a}, r0, m{a}, p;",
                f"selp.b32 m{b}, m{b}, r0, p;",
                f"selp.b32 m{c}, r1, m{c}, p;",
                f"selp.b32 m{d}, m{d}, r1, p;",
            )
        ],
        "mov.b32 $0, m0;",
        "mov.b32 $1, m1;",
        "mov.b32 $2, m2;",
        "mov.b32 $3, m3;",
        "}",
    ]
)
# the scale (or zero) pair of columns g (low) and g + 8 (high) -> each in both halves
_SPLAT = "prmt.b32 $0, $2, $2, 0x1010;\nprmt.b32 $1, $2, $2, 0x3232;"


@functools.cache
def fragment_parts() -> SimpleNamespace:
    """The Gluon pieces both wgmma GEMMs share (this one and `gluon_wgmma_tma`), built on first
    use: the words' and one-word-a-thread layouts and the dequantization of a word into its A
    fragment (Gluon is imported only here)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import constexpr_function

    dequant_asm = gl.constexpr(_DEQUANT)

    @constexpr_function
    def word_layout(num_wg):
        """Words as bf16 pairs [32 num_wg (warp w, g), 32 (c, v, half)]: lane 4 g + c of warp w
        holds its 4 words (v) of column group w: 16 contiguous bytes."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4]],
            lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[8 << i, 0] for i in range(2 + (num_wg - 1).bit_length())],
            block_bases=[],
            shape=[32 * num_wg, 32],
        )

    @constexpr_function
    def v_layout(num_wg):
        """One word per thread, as bf16 pairs [32 num_wg (w, g), 4 c, 2 half]."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[8 << i, 0, 0] for i in range(2 + (num_wg - 1).bit_length())],
            block_bases=[],
            shape=[32 * num_wg, 4, 2],
        )

    @gluon.jit
    def dequant_v(w3, sl, sh, zl, zh):
        """One word a thread ([RW, 4 c, 2 half]) -> its A fragment [RW, 4, 2 e, 2 rowhi, 2 khi]."""
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            dequant_asm, "=r,=r,=r,=r,r,r,r,r,r", [w3, sl, sh, zl, zh],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
        return gl.join(gl.join(o0, o1), gl.join(o2, o3))

    @gluon.jit
    def a_operand(words, sl, sh, zl, zh, NUM_WG: gl.constexpr, a_l: gl.constexpr):
        """A warpgroup slab's register operand [64 NUM_WG, 64] from its words [RW, 32 (c, v,
        half)] (K in the order the words give: slot order, or natural after `_QUAD_T`) and the
        splatted scale / zero pairs."""
        RW: gl.constexpr = 32 * NUM_WG
        NW: gl.constexpr = 4 * NUM_WG
        v_l: gl.constexpr = v_layout(NUM_WG)
        # one tensor per v: [RW, 4 c, 2 half]
        wv = gl.permute(gl.reshape(words, [RW, 4, 2, 2, 2]), [0, 1, 4, 2, 3])
        odd0, odd1 = gl.split(wv)  # v % 2 = 0, 1
        w0, w2 = gl.split(odd0)
        w1, w3 = gl.split(odd1)
        f0 = dequant_v(gl.convert_layout(w0, v_l, assert_trivial=True), sl, sh, zl, zh)
        f1 = dequant_v(gl.convert_layout(w1, v_l, assert_trivial=True), sl, sh, zl, zh)
        f2 = dequant_v(gl.convert_layout(w2, v_l, assert_trivial=True), sl, sh, zl, zh)
        f3 = dequant_v(gl.convert_layout(w3, v_l, assert_trivial=True), sl, sh, zl, zh)
        t = gl.join(gl.join(f0, f1), gl.join(f2, f3))
        # [RW (w, g), 4 c, 2 e, 2 rowhi, 2 khi, 2 v0, 2 v1]
        t = gl.reshape(t, [NW, 8, 4, 2, 2, 2, 2, 2])
        t = gl.permute(t, [0, 4, 1, 7, 6, 5, 2, 3])  # w, rowhi, g, v1, v0, khi, c, e
        return gl.convert_layout(gl.reshape(t, [16 * NW, 64]), a_l, assert_trivial=True)

    return SimpleNamespace(
        word_layout=word_layout, v_layout=v_layout, dequant_v=dequant_v, a_operand=a_operand
    )


@functools.cache
def _kernel():
    """The Gluon kernel, built on first use (Gluon is imported only here)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.runtime.jit import constexpr_function

    barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 / 3.6
    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None)  # Triton 3.9
    reinterpret = reinterpret or gl.shared_memory_descriptor._reinterpret  # 3.6

    @gluon.jit
    def _as_bf16(smem, shape: gl.constexpr, layout: gl.constexpr):
        return reinterpret(smem, gl.bfloat16, shape, layout)

    parts = fragment_parts()
    word_layout, v_layout, a_operand = parts.word_layout, parts.v_layout, parts.a_operand
    splat_asm = gl.constexpr(_SPLAT)
    quad_t_asm = gl.constexpr(_QUAD_T)

    @constexpr_function
    def copy_layout(block_m, nw):
        """Activation pairs [block_m, 32]: 8 lanes a row, each copying slot pairs 8 apart (real
        pairs 2 apart: one address register, immediate offsets); warps over rows first, then
        over slots where block_m has fewer than 4 rows a warp (no copy done twice)."""
        rows = max(1, min(nw, block_m // 4))
        return gl.BlockedLayout(
            size_per_thread=[1, 1],
            threads_per_warp=[4, 8],
            warps_per_cta=[rows, nw // rows],
            order=[1, 0],
        )

    @gluon.jit
    def _group(kt, kt_hi, GROUP_TILES: gl.constexpr):
        """The scale group of K tile kt, clamped to the program's last tile."""
        if GROUP_TILES > 0:
            return gl.minimum(kt, kt_hi - 1) // GROUP_TILES
        else:
            return kt * 0

    @gluon.jit
    def kernel(
        x_ptr, w_ptr, sp_ptr, zp_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
        M, N, K, kt_per_split, n_groups, stride_xm, stride_om,
        GROUP_TILES: gl.constexpr,  # K tiles per scale group (0: one scale per column)
        BLOCK_M: gl.constexpr,
        NUM_WG: gl.constexpr,  # warpgroups, each 64 weight rows sharing the activation tile
        NUM_STAGES: gl.constexpr,  # ring depth (>= 3)
        NATURAL_X: gl.constexpr,  # activations in natural K order, the words transposed
        HAS_ZP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ONE_SPLIT: gl.constexpr,  # else the serial split-K reduction through ws / cnt
        SCALE_AHEAD: gl.constexpr,  # scale / zero pairs loaded a loop trip (2 steps) ahead
        STAGED: gl.constexpr,  # the epilogue through shared memory
    ):  # fmt: skip
        BN: gl.constexpr = 64 * NUM_WG
        RW: gl.constexpr = 32 * NUM_WG
        NW: gl.constexpr = 4 * NUM_WG
        S: gl.constexpr = NUM_STAGES
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_l: gl.constexpr = word_layout(NUM_WG)
        v_l: gl.constexpr = v_layout(NUM_WG)
        xc_l: gl.constexpr = copy_layout(BLOCK_M, NW)
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        x_sl32: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=32, rank=2
        )
        x_sl: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        kt_total = K // 64
        kt_lo = pid_k * kt_per_split
        kt_hi = gl.minimum(kt_lo + kt_per_split, kt_total)

        # words: (R, C' = 4 c + v, e) of column group pid_n * NW + R // 8 at tile kt:
        #   ((cg * kt_total + kt) * 128 + 16 (R % 8) + C') * 2 + e  (bf16 elements)
        wr = gl.arange(0, RW, layout=gl.SliceLayout(1, w_l))
        wc = gl.arange(0, 32, layout=gl.SliceLayout(0, w_l))
        w_off = gl.expand_dims((wr // 8) * (kt_total * 256) + (wr % 8) * 32, 1)
        w_off = w_off + gl.expand_dims(wc, 0)
        w_ptrs = w_ptr + pid_n.to(gl.int64) * NW * kt_total * 256 + w_off  # + kt * 256
        # scale / zero pairs, one per thread (the 4 lanes of g read the same):
        #   (column group, group, g) -> ((cg * n_groups + grp) * 8 + g) * 2 + e
        sr = gl.arange(0, RW, layout=gl.SliceLayout(1, gl.SliceLayout(2, v_l)))
        sc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, v_l)))
        se = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, v_l)))
        s_row = (pid_n * NW + sr // 8) * (n_groups * 16) + (sr % 8) * 2
        s_off = (
            gl.expand_dims(gl.expand_dims(s_row, 1), 2)
            + gl.expand_dims(gl.expand_dims(sc * 0, 0), 2)
            + gl.expand_dims(gl.expand_dims(se, 0), 1)
        )  # + grp * 16
        if NATURAL_X:  # 16-byte copies, 8 lanes a row (the NVMMA layout wgmma reads)
            xk_l: gl.constexpr = gl.BlockedLayout(
                size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[NW, 1],
                order=[1, 0],
            )  # fmt: skip
            x_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xk_l))
            x_k = gl.arange(0, 64, layout=gl.SliceLayout(0, xk_l))
            x_mask = gl.expand_dims(x_m < M, 1)
            x_ptrs = x_ptr + gl.expand_dims(x_m, 1) * (2 * stride_xm) + gl.expand_dims(x_k, 0)
            x_step = 64
        else:
            # activations in slot order: slot pair s <- real pair 8 (s % 4) + 2 (s // 8) +
            # (s // 4) % 2
            x_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xc_l))
            x_s = gl.arange(0, 32, layout=gl.SliceLayout(0, xc_l))
            x_real = 8 * (x_s % 4) + 2 * (x_s // 8) + (x_s // 4) % 2
            x_mask = gl.expand_dims(x_m < M, 1)
            x_ptrs = x_ptr + gl.expand_dims(x_m, 1) * stride_xm + gl.expand_dims(x_real, 0)
            x_step = 32

        w_smem = gl.allocate_shared_memory(gl.bfloat16, [S, RW, 32], w_sl)
        if NATURAL_X:
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_M, 64], x_sl)
        else:
            x_smem = gl.allocate_shared_memory(gl.int32, [S, BLOCK_M, 32], x_sl32)
        acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma)

        # cp.async ring, one commit group per operand and step: W(0), X(0), W(1), X(1), ...
        async_load(w_smem.index(0), w_ptrs + kt_lo * 256)
        async_copy.commit_group()
        for p in gl.static_range(S - 2):
            kx = gl.minimum(kt_lo + p, kt_hi - 1)
            async_load(x_smem.index(p), x_ptrs + kx * x_step, mask=x_mask & (kt_lo + p < kt_hi))
            async_copy.commit_group()
            kw = gl.minimum(kt_lo + p + 1, kt_hi - 1)
            async_load(w_smem.index(p + 1), w_ptrs + kw * 256)
            async_copy.commit_group()
        pairs = gl.maximum((kt_hi - kt_lo + 1) // 2, 1)
        if SCALE_AHEAD:  # the raw pairs of steps kt_lo, kt_lo + 1 (clamped to the last step)
            sa0 = gl.load(sp_ptr + s_off + _group(kt_lo, kt_hi, GROUP_TILES) * 16)
            sa1 = gl.load(sp_ptr + s_off + _group(kt_lo + 1, kt_hi, GROUP_TILES) * 16)
            if HAS_ZP:
                za0 = gl.load(zp_ptr + s_off + _group(kt_lo, kt_hi, GROUP_TILES) * 16)
                za1 = gl.load(zp_ptr + s_off + _group(kt_lo + 1, kt_hi, GROUP_TILES) * 16)
            else:
                za0 = sa0
                za1 = sa1
        else:
            sa0 = gl.zeros([RW, 4, 2], gl.bfloat16, layout=v_l)
            sa1 = sa0
            za0 = sa0
            za1 = sa0
        for pair in range(pairs):
            for u in gl.static_range(2):
                kt = kt_lo + 2 * pair + u
                i = kt - kt_lo
                async_copy.wait_group(2 * S - 5)
                barrier()
                fence_async_shared()
                kx = kt + S - 2
                async_load(
                    x_smem.index((i + S - 2) % S),
                    x_ptrs + gl.minimum(kx, kt_hi - 1) * x_step,
                    mask=x_mask & (kx < kt_hi),
                )
                async_copy.commit_group()
                kw = gl.minimum(kt + S - 1, kt_hi - 1)
                async_load(w_smem.index((i + S - 1) % S), w_ptrs + kw * 256)
                async_copy.commit_group()

                if SCALE_AHEAD:  # this step's pairs, then those of the step a trip ahead
                    grp_next = _group(kt + 2, kt_hi, GROUP_TILES)
                    if u == 0:
                        s_raw = sa0
                        z_raw = za0
                        sa0 = gl.load(sp_ptr + s_off + grp_next * 16)
                        if HAS_ZP:
                            za0 = gl.load(zp_ptr + s_off + grp_next * 16)
                    else:
                        s_raw = sa1
                        z_raw = za1
                        sa1 = gl.load(sp_ptr + s_off + grp_next * 16)
                        if HAS_ZP:
                            za1 = gl.load(zp_ptr + s_off + grp_next * 16)
                else:
                    grp = _group(kt, kt_hi, GROUP_TILES)
                    s_raw = gl.load(sp_ptr + s_off + grp * 16)
                    if HAS_ZP:
                        z_raw = gl.load(zp_ptr + s_off + grp * 16)
                sl, sh = gl.inline_asm_elementwise(
                    splat_asm, "=r,=r,r", [s_raw],
                    dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=2,
                )  # fmt: skip
                if HAS_ZP:
                    zl, zh = gl.inline_asm_elementwise(
                        splat_asm, "=r,=r,r", [z_raw],
                        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=2,
                    )  # fmt: skip
                else:  # -136 = -(128 + 8)
                    zl = gl.full([RW, 4, 2], -136.0, gl.bfloat16, layout=v_l)
                    zh = zl
                words = w_smem.index(i % S).load(w_l)  # [RW, 32 (c, v, half)]
                if NATURAL_X:  # now word v of lane c is its word for natural slice v
                    words = gl.inline_asm_elementwise(
                        quad_t_asm, "=r,=r,=r,=r,r,r,r,r", [words], dtype=gl.bfloat16,
                        is_pure=True, pack=8,
                    )  # fmt: skip
                a = a_operand(words, sl, sh, zl, zh, NUM_WG, a_l)
                if NATURAL_X:
                    xs = x_smem.index(i % S)
                else:
                    xs = _as_bf16(x_smem.index(i % S), [BLOCK_M, 64], x_sl)
                acc = warpgroup_mma(a, xs.permute((1, 0)), acc, is_async=True)
                acc, a, xs = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a, xs])
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)

        if STAGED:
            # The tile goes through the activation ring (free now) as fp32 [BLOCK_M, BN], then
            # out in chunks of CH rows, 4 contiguous columns a thread: few live registers in
            # the epilogue (it sets the kernel's count) and vector accesses along N.
            CH: gl.constexpr = 16 if BLOCK_M >= 16 else BLOCK_M
            TN: gl.constexpr = BN // 4 if BN < 128 else 32
            ep_l: gl.constexpr = gl.BlockedLayout(
                size_per_thread=[1, 4], threads_per_warp=[32 // TN, TN], warps_per_cta=[NW, 1],
                order=[1, 0],
            )  # fmt: skip
            st_sl: gl.constexpr = gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[1, 0]
            )
            barrier()  # every warpgroup's MMAs have read their last activation stage
            stage = reinterpret(x_smem, gl.float32, [BLOCK_M, BN], st_sl)
            stage.permute((1, 0)).store(acc)
            barrier()
            e_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ep_l))
            e_r = gl.arange(0, CH, layout=gl.SliceLayout(1, ep_l))
            if HAS_BIAS:
                e_b = gl.expand_dims(gl.load(b_ptr + e_n).to(gl.float32), 0)
            if ONE_SPLIT:
                for c in gl.static_range(BLOCK_M // CH):
                    e_m = pid_m * BLOCK_M + c * CH + e_r
                    e_mask = gl.expand_dims(e_m < M, 1)
                    v = stage.slice(c * CH, CH).load(ep_l)
                    if HAS_BIAS:
                        v = v + e_b
                    e_o = gl.expand_dims(e_m, 1) * stride_om + gl.expand_dims(e_n, 0)
                    gl.store(out_ptr + e_o, v.to(gl.bfloat16), mask=e_mask)
            else:
                for c in gl.static_range(BLOCK_M // CH):
                    e_m = pid_m * BLOCK_M + c * CH + e_r
                    e_mask = gl.expand_dims(e_m < M, 1)
                    v = stage.slice(c * CH, CH).load(ep_l)
                    e_w = gl.expand_dims(e_m, 1) * N + gl.expand_dims(e_n, 0)
                    gl.atomic_add(ws_ptr + e_w, v, mask=e_mask, sem="relaxed")
                barrier()
                tile = pid_m * gl.num_programs(0) + pid_n
                done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if done == gl.num_programs(2) - 1:
                    # The whole tile's exchanges before any store: one round trip to the L2
                    # (a store between two exchanges would keep them in order).
                    f_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ep_l))
                    f_mask = gl.expand_dims(f_m < M, 1)
                    f_w = gl.expand_dims(f_m, 1) * N + gl.expand_dims(e_n, 0)
                    zero = gl.zeros([BLOCK_M, BN], gl.int32, layout=ep_l)
                    bits = gl.atomic_xchg(wsi_ptr + f_w, zero, mask=f_mask, sem="relaxed")
                    total = bits.to(gl.float32, bitcast=True)
                    if HAS_BIAS:
                        total = total + e_b
                    f_o = gl.expand_dims(f_m, 1) * stride_om + gl.expand_dims(e_n, 0)
                    gl.store(out_ptr + f_o, total.to(gl.bfloat16), mask=f_mask)
                    gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
        else:
            o_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
            o_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            o_mask = gl.expand_dims(o_m < M, 0)
            o_idx = gl.expand_dims(o_m, 0) * stride_om + gl.expand_dims(o_n, 1)
            if ONE_SPLIT:
                if HAS_BIAS:
                    acc = acc + gl.expand_dims(gl.load(b_ptr + o_n).to(gl.float32), 1)
                gl.store(out_ptr + o_idx, acc.to(gl.bfloat16), mask=o_mask)
            else:
                w_idx = gl.expand_dims(o_m, 0) * N + gl.expand_dims(o_n, 1)
                gl.atomic_add(ws_ptr + w_idx, acc, mask=o_mask, sem="relaxed")
                barrier()
                tile = pid_m * gl.num_programs(0) + pid_n
                done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if done == gl.num_programs(2) - 1:
                    zero = gl.zeros([BN, BLOCK_M], gl.int32, layout=mma)
                    bits = gl.atomic_xchg(wsi_ptr + w_idx, zero, mask=o_mask, sem="relaxed")
                    total = bits.to(gl.float32, bitcast=True)
                    if HAS_BIAS:
                        total = total + gl.expand_dims(gl.load(b_ptr + o_n).to(gl.float32), 1)
                    gl.store(out_ptr + o_idx, total.to(gl.bfloat16), mask=o_mask)
                    gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")

    return kernel


def wgmma_smem_bytes(block_m: int, wgs: int, stages: int) -> int:
    """The ring: per stage the activation tile (bf16) and the warpgroups' words."""
    return stages * (block_m * BLOCK_K * 2 + wgs * BLOCK_N * BLOCK_K // 2)


SMALL_LAYER = 32 << 20  # weights (16 MiB packed): below it, two programs along M from 33 rows


def default_wgmma_config(m: int, n: int, k: int, num_sms: int) -> WgmmaConfig:
    """Chosen from H200 config sweeps (`benchmarks/quant/bench_w4a16_tc.py --sweep`): one program
    along M up to 32 rows (BLOCK_M the smallest that holds M) with the activations in slot
    order; from 33 rows BLOCK_M 64 on
    layers of >= 32 Mi weights (two programs would read them twice from HBM) and half the
    rows on smaller ones (more programs, the weights stay in the L2), the activations in
    natural K order (16-byte copies); two warpgroups only on layers with few columns and a long
    K (below); split-K to about two programs an SM when there are fewer than one; a 4-stage
    ring; the scale pairs a loop trip ahead in slot order, the epilogue staged through shared
    memory from 64 rows."""
    p2 = next((b for b in BLOCK_MS if b >= m), MAX_BLOCK_M)
    if p2 <= 32:
        block_m, natural = p2, False
    else:
        block_m = 64 if n * k >= SMALL_LAYER else min(128, p2) // 2
        natural = True
    m_tiles = -(-m // block_m)
    # two warpgroups a program only with a long K, and there where N is too short to fill the
    # GPU with two-warpgroup programs or the tile is 32 rows; else one (more programs an SM)
    few = m_tiles * (n // (2 * BLOCK_N)) < num_sms or block_m == 32
    two = n % (2 * BLOCK_N) == 0 and k > 32 * BLOCK_K and few
    wgs = 2 if two else 1
    programs = m_tiles * (n // (BLOCK_N * wgs))
    split = 1
    if programs < num_sms:  # about two programs an SM, and at most ~36 K steps a split
        split = max(round(2 * num_sms / programs), -(-k // (36 * BLOCK_K)))
        split = max(1, min(16, split))
    return block_m, wgs, split, 4, natural, not natural, block_m >= 64


def check_inputs(
    name: str, x: torch.Tensor, n: int, group_size: int, bias, supported: bool, shapes: str
) -> None:
    """The ValueErrors both wgmma GEMMs raise for inputs they do not take."""
    k = x.shape[1]
    if x.dtype != torch.bfloat16 or not x.is_cuda or not supported:
        raise ValueError(
            f"{name} takes CUDA bf16 x, {shapes}, K % 64 == 0 and groups of whole 64-K tiles, "
            f"got {x.dtype} on {x.device}, N={n} K={k} group={group_size}"
        )
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")


def split_k_scratch(
    workspace: SplitKWorkspace | None,
    out: torch.Tensor,
    words: torch.Tensor,
    grid: tuple[int, int, int],
    per: int,
    kt_total: int,
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int, int]]:
    """(fp32 partials, int32 counters, K tiles a split, grid) of a launch with grid[2] splits:
    the workspace's buffers, or one split where there is none (or a CUDA graph is being
    captured with one too small to grow). Without split-K the kernel reads neither buffer
    (placeholders: an empty view of `out`, `words`)."""
    ws, cnt = out.view(-1)[:0].float(), words
    if grid[2] > 1:
        m, n = out.shape
        bufs = workspace.buffers(out.device, m * n, grid[0] * grid[1]) if workspace else None
        if bufs is None:
            return ws, cnt, kt_total, (grid[0], grid[1], 1)
        ws, cnt = bufs
    return ws, cnt, per, grid


def wna16_mma_wgmma(
    x: torch.Tensor,  # [M, K] bf16, CUDA, sm_90
    words: torch.Tensor,  # `repack_mma`
    scale_pairs: torch.Tensor,  # `repack_mma_scales`
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    zero_pairs: torch.Tensor | None = None,  # `repack_mma_zeros` (None: symmetric, z = 8)
    workspace: SplitKWorkspace | None = None,  # split-K scratch (None: no split-K)
    config: WgmmaConfig | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """y = x @ dequant(W).T (+ bias) for W stored by `repack_mma`, W = (u - z) * s per group."""
    m, k = x.shape
    supported = wgmma_supported(n, k, group_size)
    check_inputs("wna16_mma_wgmma", x, n, group_size, bias, supported, "N % 64 == 0")
    num_sms = platform.num_sms(x.device)
    block_m, wgs, split, stages, *rest = config or default_wgmma_config(m, n, k, num_sms)
    natural = bool(rest[0]) if rest else False
    scale_ahead = bool(rest[1]) if len(rest) > 1 else False
    staged = bool(rest[2]) if len(rest) > 2 else False
    if staged and stages < 2 * wgs:
        raise ValueError(f"config {config}: the staged epilogue needs >= {2 * wgs} stages")
    if block_m not in BLOCK_MS or n % (BLOCK_N * wgs):
        raise ValueError(f"config {config}: BLOCK_M in {BLOCK_MS}, N % {BLOCK_N * wgs} == 0")
    if stages < 3 or wgmma_smem_bytes(block_m, wgs, stages) > SMEM_BYTES:
        raise ValueError(f"{stages} stages: at least 3, and within {SMEM_BYTES} bytes")
    kt_total = k // BLOCK_K
    per = -(-kt_total // split)
    split = -(-kt_total // per)
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()
    xi = x.view(torch.int32)
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    grid = (n // (BLOCK_N * wgs), -(-m // block_m), split)
    ws, cnt, per, grid = split_k_scratch(workspace, out, words, grid, per, kt_total)
    split = grid[2]
    per_channel = group_size <= 0 or group_size >= k
    sp = scale_pairs.view(torch.bfloat16)
    _kernel()[grid](
        x if natural else xi, words.view(torch.bfloat16), sp,
        zero_pairs.view(torch.bfloat16) if zero_pairs is not None else sp,
        bias if bias is not None else out, out, ws, ws.view(torch.int32), cnt,
        m, n, k, per, scale_pairs.shape[1], xi.stride(0), out.stride(0),
        GROUP_TILES=0 if per_channel else group_size // BLOCK_K,
        BLOCK_M=block_m,
        NUM_WG=wgs,
        NUM_STAGES=stages,
        NATURAL_X=natural,
        HAS_ZP=zero_pairs is not None,
        HAS_BIAS=bias is not None,
        ONE_SPLIT=split == 1,
        SCALE_AHEAD=scale_ahead,
        STAGED=staged,
        num_warps=4 * wgs,
    )  # fmt: skip
    return out


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX `prmt.b32 d, a, b, sel` (bytes 0-3 of a, 4-7 of b) on int64 words."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _quad_transpose(word: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """`_QUAD_T` in torch: word[v] [R, c] (lane c's words) -> word'[V] [R, c], lane c's word for
    natural slice V (the prmt messages, then the transpose across the quad's lanes)."""
    msg = {
        cr: _prmt(word[cr // 2], word[2 + cr // 2], 0x7351 if cr % 2 else 0x6240) for cr in range(4)
    }  # msg[receiver][R, sender]
    return {v: torch.stack([msg[cr][:, v] for cr in range(4)], -1) for v in range(4)}


def unpack_slots(
    words: torch.Tensor, n: int, k: int, num_wg: int = 1, natural: bool = False
) -> torch.Tensor:
    """The kernel's unpacking in torch, step by step (reshape, permute, split, the asm's nibble
    choice, join as `torch.stack(..., -1)`; with `natural` the quad transpose first): the code
    [N, K] that it feeds to each row and shared-memory slot of every 64-K tile (slot order,
    see `slot_to_real_pair`, or natural K order)."""
    nw, rw = 4 * num_wg, 32 * num_wg
    ncg, kt_total = n // 16, k // BLOCK_K
    u = words.view(ncg, kt_total, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF  # cg, kt, g, c, v
    halves = torch.stack((u & 0xFFFF, u >> 16), -1)  # the bf16 view: [..., v, e]
    out = torch.empty(n, k, dtype=torch.int64)
    for prog in range(ncg // nw):
        for kt in range(kt_total):
            w = halves[prog * nw : (prog + 1) * nw, kt].reshape(rw, 32)  # [R, (c, v, e)]
            wv = w.reshape(rw, 4, 2, 2, 2).permute(0, 1, 4, 2, 3)  # R, c, e, v1, v0
            word = {}
            for v1 in range(2):
                for v0 in range(2):
                    pair = wv[..., v1, v0]  # [R, c, e]: one 32-bit register a thread
                    word[2 * v1 + v0] = pair[..., 0] | (pair[..., 1] << 16)
            if natural:
                word = _quad_transpose(word)
            f = []
            for v in range(4):
                o = [(word[v] >> (4 * s)) & 0x000F000F for s in range(4)]  # the asm's lop3
                o = [torch.stack((r & 0xF, r >> 16), -1) for r in o]  # [R, c, e]
                f.append(torch.stack((torch.stack((o[0], o[1]), -1),
                                      torch.stack((o[2], o[3]), -1)), -1))  # fmt: skip
            t = torch.stack((torch.stack((f[0], f[1]), -1), torch.stack((f[2], f[3]), -1)), -1)
            t = t.reshape(nw, 8, 4, 2, 2, 2, 2, 2).permute(0, 4, 1, 7, 6, 5, 2, 3)
            rows = slice(prog * 16 * nw, (prog + 1) * 16 * nw)
            out[rows, kt * BLOCK_K : (kt + 1) * BLOCK_K] = t.reshape(16 * nw, BLOCK_K)
    return out.to(torch.int32)

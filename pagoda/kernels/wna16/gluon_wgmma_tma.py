"""W4A16 GEMM on Hopper: a TMA ring feeding warpgroup MMAs, on the tensor-core GEMV's layout.

Swap-AB as in `gluon_mma_wgmma`: out^T [N, M] = W [N, K] x^T [K, M], the weight (dequantized in
registers) is wgmma's register operand A and the activation tile its shared-memory operand B, so
the batch (up to 128 rows a tile) is the MMA's N. What differs is where the bytes come from and
how many weight rows share one activation tile:

- A CTA covers `128 * warpgroups` weight rows: each consumer warpgroup owns two 64-row slabs
  (two accumulators), so every activation tile read from the L2 feeds 128 or 256 weight rows
  (the activations are re-read N / rows-per-CTA times).
- One producer warp (`gl.warp_specialize`) issues the bulk tensor copies (TMA) of each K step's
  activation tile [BLOCK_M, 64] (128-byte swizzle, natural K order, rows past M zero-filled),
  the CTA's packed words [rows / 16 column groups, 128 words] and their scale (and zero) pairs
  into a ring of NUM_STAGES stages, completing on an mbarrier per stage; the consumers release a
  stage through a second mbarrier once both MMAs that read it have retired.
- The consumers turn each lane's 4 words (16 bytes) into its A fragments: the quad transpose
  (`_QUAD_T`) gives natural K order, then `_DEQUANT`
  (lop3 to 128 + u, add the zero offset, mul by the scale: the reference's bf16 exactly).
  Slab 0 of step i is dequantized while slab 1 of step i - 1 is still on the tensor cores and
  the other way round: one wait for one group before each slab keeps a single MMA in flight
  over every dequantization, with distinct registers.

The grid is one-dimensional, tiles numbered M-tile first (a column tile's weights read from DRAM
once). `tail_schedule`: whole waves of tiles (one CTA a tile), then the tiles left are split over
K so the last wave is full; a split tile's CTAs add fp32 partials into the runner's
`SplitKWorkspace` (the last CTA of a tile stores the output and re-zeroes what it used). The
epilogue passes each slab through the (free) activation ring as fp32 and stores or adds 16-row
chunks of 4 contiguous columns a thread.

sm_90 only. The CPU tests compile it for sm_90 (bulk tensor copies, wgmma, warp specialization in
the PTX); the GPU tests compare it with the dequantized matmul.
"""

# (no `from __future__ import annotations`: the partitions' `gl.constexpr` annotations are
# evaluated where `_kernel` defines them, as warp specialization needs)
import functools

import torch

from pagoda import platform
from pagoda.kernels.wna16.tuned_tables import TUNED_DIR, gpu_entries
from pagoda.kernels.workspace import SplitKWorkspace

BLOCK_K = 64  # K per ring stage (one tile of the layout)
SLAB = 64  # weight rows per warpgroup accumulator (wgmma's M)
BLOCK_MS = (16, 32, 64, 128)  # batch rows a tile (wgmma's N)
SMEM_BYTES = 227 * 1024  # sm_90's shared memory per block

# (BLOCK_M, warpgroups, split-K of the last wave's tiles, stages[, slabs a warpgroup: 2, or 1
# with BLOCK_M up to 256])
TmaConfig = tuple
ONE_SLAB_BLOCK_MS = BLOCK_MS + (256,)  # one slab a warpgroup: wgmma's N up to 256


def tma_supported(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel takes: whole 16-row column groups, whole K tiles, groups of whole tiles."""
    per_channel = group_size <= 0 or group_size >= k
    return n % 16 == 0 and k % BLOCK_K == 0 and (per_channel or group_size % BLOCK_K == 0)


@functools.cache
def gluon_tma_available() -> bool:
    """Gluon with Hopper's bulk tensor copies, mbarriers, warpgroup MMA and warp specialization."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            mbarrier,
            tma,
            warpgroup_mma,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


def rows_per_cta(warpgroups: int, slabs: int = 2) -> int:
    return slabs * SLAB * warpgroups


def stage_bytes(block_m: int, wgs: int, zp: bool, slabs: int = 2) -> int:
    """One ring stage: the activation tile, the words and the scale (zero) pairs of the CTA."""
    rows = rows_per_cta(wgs, slabs)
    return block_m * BLOCK_K * 2 + rows * BLOCK_K // 2 + rows * 2 * (2 if zp else 1)


def smem_bytes(block_m: int, wgs: int, stages: int, zp: bool, slabs: int = 2) -> int:
    return stages * stage_bytes(block_m, wgs, zp, slabs) + 2 * stages * 8


@functools.cache
def _kernel():
    """The Gluon kernel, built on first use (Gluon is imported only here)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from pagoda.kernels.wna16.gluon_mma_wgmma import _QUAD_T, _SPLAT, fragment_parts

    barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 / 3.6
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.9 / 3.6
    reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None)  # Triton 3.9
    reinterpret = reinterpret or gl.shared_memory_descriptor._reinterpret  # 3.6

    BK = gl.constexpr(BLOCK_K)
    SL = gl.constexpr(SLAB)
    splat_asm = gl.constexpr(_SPLAT)
    quad_t_asm = gl.constexpr(_QUAD_T)
    parts = fragment_parts()
    word_layout, v_layout, a_operand = parts.word_layout, parts.v_layout, parts.a_operand

    @gluon.jit
    def _fragment(w_st, s_st, z_st, NUM_WG: gl.constexpr, BLOCK_M: gl.constexpr,
                  HAS_ZP: gl.constexpr):  # fmt: skip
        """A slab's register operand [64 NUM_WG, 64] from its words and pairs in shared memory
        (bf16 views [RW, 32] and [RW, 2]): K in natural order (the words through the quad
        transpose)."""
        RW: gl.constexpr = 32 * NUM_WG
        NW: gl.constexpr = 4 * NUM_WG
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        v_l: gl.constexpr = v_layout(NUM_WG)
        p_l: gl.constexpr = gl.SliceLayout(1, v_l)  # [RW, 2]: the 4 lanes c of g share a pair
        s_raw = gl.expand_dims(s_st.load(p_l), 1)  # [RW, 1, 2]
        sl, sh = gl.inline_asm_elementwise(
            splat_asm, "=r,=r,r", [s_raw], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
        if HAS_ZP:
            z_raw = gl.expand_dims(z_st.load(p_l), 1)
            zl, zh = gl.inline_asm_elementwise(
                splat_asm, "=r,=r,r", [z_raw], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                pack=2,
            )  # fmt: skip
        else:  # -136 = -(128 + 8)
            zl = gl.full([RW, 1, 2], -136.0, gl.bfloat16, layout=v_l)
            zh = zl
        words = w_st.load(word_layout(NUM_WG))  # [RW, 32 (c, v, half)]
        # word v of lane c becomes its word for natural K slice v
        words = gl.inline_asm_elementwise(
            quad_t_asm, "=r,=r,=r,=r,r,r,r,r", [words], dtype=gl.bfloat16, is_pure=True, pack=8,
        )  # fmt: skip
        return a_operand(words, sl, sh, zl, zh, NUM_WG, a_l)

    @gluon.jit
    def _produce(x_desc, w_desc, s_desc, z_desc, x_bufs, w_bufs, s_bufs, z_bufs, ready, empty,
                 off_m, cg0, kt_lo, n_steps, NUM_STAGES: gl.constexpr, GROUP_TILES: gl.constexpr,
                 HAS_ZP: gl.constexpr):  # fmt: skip
        """One warp: wait for a free stage, then the step's copies complete on its `ready`."""
        nbytes: gl.constexpr = (
            x_desc.block_type.nbytes
            + w_desc.block_type.nbytes
            + s_desc.block_type.nbytes * (2 if HAS_ZP else 1)
        )
        for i in range(n_steps):
            s = i % NUM_STAGES
            mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            kt = kt_lo + i
            if GROUP_TILES > 0:
                grp = kt // GROUP_TILES
            else:
                grp = kt * 0
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma_load(x_desc, [off_m, kt * BK], bar, x_bufs.index(s))
            tma_load(w_desc, [cg0, kt * 128], bar, w_bufs.index(s))
            tma_load(s_desc, [cg0, grp * 8], bar, s_bufs.index(s))
            if HAS_ZP:
                tma_load(z_desc, [cg0, grp * 8], bar, z_bufs.index(s))

    @gluon.jit
    def _epilogue_slab(acc, stage, e_r, e_n, n_ok, off_m, b_ptr, out_ptr, ws_ptr, M, N,
                       stride_om, BLOCK_M: gl.constexpr, ep_l: gl.constexpr,
                       HAS_BIAS: gl.constexpr, ONE_SPLIT: gl.constexpr):  # fmt: skip
        """One slab's tile through shared memory: stored (one split) or added into ws."""
        CH: gl.constexpr = 16 if BLOCK_M >= 16 else BLOCK_M
        barrier()  # the previous user of `stage` is done
        stage.permute((1, 0)).store(acc)
        barrier()
        if HAS_BIAS:
            e_b = gl.expand_dims(gl.load(b_ptr + e_n, mask=n_ok, other=0.0).to(gl.float32), 0)
        for c in gl.static_range(BLOCK_M // CH):
            e_m = off_m + c * CH + e_r
            e_mask = gl.expand_dims(e_m < M, 1) & gl.expand_dims(n_ok, 0)
            v = stage.slice(c * CH, CH).load(ep_l)
            if ONE_SPLIT:
                if HAS_BIAS:
                    v = v + e_b
                e_o = gl.expand_dims(e_m, 1) * stride_om + gl.expand_dims(e_n, 0)
                gl.store(out_ptr + e_o, v.to(gl.bfloat16), mask=e_mask)
            else:
                e_w = gl.expand_dims(e_m, 1) * N + gl.expand_dims(e_n, 0)
                gl.atomic_add(ws_ptr + e_w, v, mask=e_mask, sem="relaxed")

    @gluon.jit
    def _finish_slab(e_n, n_ok, off_m, b_ptr, out_ptr, wsi_ptr, M, N, stride_om,
                     BLOCK_M: gl.constexpr, ep_l: gl.constexpr,
                     HAS_BIAS: gl.constexpr):  # fmt: skip
        """The last split of a tile: read the slab's sums back (re-zeroing them) and store.
        All of the slab's exchanges are issued before the first store (one round trip to the
        L2, not one per row chunk: a store between two exchanges keeps them in order)."""
        TN: gl.constexpr = e_n.shape[0]
        e_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ep_l))
        e_mask = gl.expand_dims(e_m < M, 1) & gl.expand_dims(n_ok, 0)
        e_w = gl.expand_dims(e_m, 1) * N + gl.expand_dims(e_n, 0)
        zero = gl.zeros([BLOCK_M, TN], gl.int32, layout=ep_l)
        bits = gl.atomic_xchg(wsi_ptr + e_w, zero, mask=e_mask, sem="relaxed")
        total = bits.to(gl.float32, bitcast=True)
        if HAS_BIAS:
            total = total + gl.expand_dims(
                gl.load(b_ptr + e_n, mask=n_ok, other=0.0).to(gl.float32), 0
            )
        e_o = gl.expand_dims(e_m, 1) * stride_om + gl.expand_dims(e_n, 0)
        gl.store(out_ptr + e_o, total.to(gl.bfloat16), mask=e_mask)

    @gluon.jit
    def _store_tile(acc0, acc1, x_bufs, off_m, off_n, tile, b_ptr, out_ptr, ws_ptr, wsi_ptr,
                    cnt_ptr, M, N, stride_om, n_splits, BLOCK_M: gl.constexpr,
                    NUM_WG: gl.constexpr, HAS_BIAS: gl.constexpr, ONE_SPLIT: gl.constexpr,
                    SLABS: gl.constexpr):  # fmt: skip
        """The epilogue of SLABS slabs (acc1 unused with one): each through the activation ring
        (free now) as fp32 [BLOCK_M, BNW], stored or added into the split-K workspace (the
        tile's last split then reads the sums back, 128 rows a round trip)."""
        NW: gl.constexpr = 4 * NUM_WG
        BNW: gl.constexpr = SL * NUM_WG
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        TN: gl.constexpr = BNW // 4 if BNW < 128 else 32
        ep_l: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 4], threads_per_warp=[32 // TN, TN], warps_per_cta=[NW, 1],
            order=[1, 0],
        )  # fmt: skip
        stage = reinterpret(x_bufs, gl.float32, [BLOCK_M, BNW], plain)
        CH: gl.constexpr = 16 if BLOCK_M >= 16 else BLOCK_M
        e_r = gl.arange(0, CH, layout=gl.SliceLayout(1, ep_l))
        e_n0 = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(0, ep_l))
        e_n1 = e_n0 + BNW
        n_ok0 = e_n0 < N
        n_ok1 = e_n1 < N
        if ONE_SPLIT:  # noqa: SIM114 - a constexpr: the split path is not compiled in
            _epilogue_slab(acc0, stage, e_r, e_n0, n_ok0, off_m, b_ptr, out_ptr, ws_ptr, M, N,
                           stride_om, BLOCK_M, ep_l, HAS_BIAS, True)  # fmt: skip
            if SLABS == 2:
                _epilogue_slab(acc1, stage, e_r, e_n1, n_ok1, off_m, b_ptr, out_ptr, ws_ptr, M,
                               N, stride_om, BLOCK_M, ep_l, HAS_BIAS, True)  # fmt: skip
        elif n_splits == 1:  # a whole tile of a launch that splits its last ones
            _epilogue_slab(acc0, stage, e_r, e_n0, n_ok0, off_m, b_ptr, out_ptr, ws_ptr, M, N,
                           stride_om, BLOCK_M, ep_l, HAS_BIAS, True)  # fmt: skip
            if SLABS == 2:
                _epilogue_slab(acc1, stage, e_r, e_n1, n_ok1, off_m, b_ptr, out_ptr, ws_ptr, M,
                               N, stride_om, BLOCK_M, ep_l, HAS_BIAS, True)  # fmt: skip
        else:
            _epilogue_slab(acc0, stage, e_r, e_n0, n_ok0, off_m, b_ptr, out_ptr, ws_ptr, M, N,
                           stride_om, BLOCK_M, ep_l, HAS_BIAS, False)  # fmt: skip
            if SLABS == 2:
                _epilogue_slab(acc1, stage, e_r, e_n1, n_ok1, off_m, b_ptr, out_ptr, ws_ptr, M,
                               N, stride_om, BLOCK_M, ep_l, HAS_BIAS, False)  # fmt: skip
            barrier()
            done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if done == n_splits - 1:
                FR: gl.constexpr = 128 if BLOCK_M > 128 else BLOCK_M  # (256 rows would spill)
                for h in gl.static_range(BLOCK_M // FR):
                    _finish_slab(e_n0, n_ok0, off_m + h * FR, b_ptr, out_ptr, wsi_ptr, M, N,
                                 stride_om, FR, ep_l, HAS_BIAS)  # fmt: skip
                if SLABS == 2:
                    _finish_slab(e_n1, n_ok1, off_m, b_ptr, out_ptr, wsi_ptr, M, N, stride_om,
                                 BLOCK_M, ep_l, HAS_BIAS)  # fmt: skip
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")

    @gluon.jit
    def _consume(x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, n_steps, off_m, off_n, tile,
                 b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, M, N, stride_om, n_splits,
                 BLOCK_M: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                 HAS_ZP: gl.constexpr, HAS_BIAS: gl.constexpr,
                 ONE_SPLIT: gl.constexpr, SLABS: gl.constexpr):  # fmt: skip
        """The consumer warpgroups: dequantize, MMA, release stages; then the epilogue.

        SLABS 2: two 64-row slabs a warpgroup; slab 0 of step i is dequantized while slab 1 of
        step i - 1 is on the tensor cores and the other way round. SLABS 1: one slab a
        warpgroup (wgmma's N = BLOCK_M up to 256, so one dequantization feeds twice the MMA
        work of a 128-row tile): two K steps a loop trip, each with its own fragment
        registers, so step i + 1 is dequantized while step i is on the tensor cores; n_steps
        is even (the host's rule)."""
        RW: gl.constexpr = 32 * NUM_WG
        NW: gl.constexpr = 4 * NUM_WG
        BNW: gl.constexpr = SL * NUM_WG  # rows of one slab across the warpgroups
        S: gl.constexpr = NUM_STAGES
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
        )
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        if SLABS == 2:
            acc0 = gl.zeros([BNW, BLOCK_M], gl.float32, layout=mma)
            acc1 = gl.zeros([BNW, BLOCK_M], gl.float32, layout=mma)
            # every split has a step (the host's rule); a trip count the compiler knows to be >= 1
            # leaves no zero-trip path that re-defines the accumulators while MMAs are in flight
            # (ptxas would serialize every wgmma of the kernel: C7515)
            for i in range(gl.maximum(n_steps, 1)):
                s = i % S
                mbarrier.wait(ready.index(s), (i // S) & 1)
                xs = x_bufs.index(s).permute((1, 0))  # [64, BLOCK_M]
                w_st = reinterpret(w_bufs.index(s), gl.bfloat16, [2 * RW, 32], plain)
                s_st = reinterpret(s_bufs.index(s), gl.bfloat16, [2 * RW, 2], plain)
                if HAS_ZP:
                    z_st = reinterpret(z_bufs.index(s), gl.bfloat16, [2 * RW, 2], plain)
                    z0 = z_st.slice(0, RW)
                    z1 = z_st.slice(RW, RW)
                else:
                    z0 = s_st
                    z1 = s_st
                # One MMA in flight over each dequantization: slab 0 of step i is dequantized while
                # slab 1 of step i - 1 runs, slab 1 while slab 0 of step i runs (each wait retires
                # the group before the one just issued).
                a0 = _fragment(w_st.slice(0, RW), s_st.slice(0, RW), z0, NUM_WG, BLOCK_M, HAS_ZP)
                acc0 = warpgroup_mma(a0, xs, acc0, is_async=True)
                acc0, a0, xs = warpgroup_mma_wait(num_outstanding=1, deps=[acc0, a0, xs])
                # both MMAs of step i - 1 have retired: its stage goes back to the producer
                mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
                a1 = _fragment(w_st.slice(RW, RW), s_st.slice(RW, RW), z1, NUM_WG, BLOCK_M, HAS_ZP)
                acc1 = warpgroup_mma(a1, xs, acc1, is_async=True)
                acc1, a1, xs = warpgroup_mma_wait(num_outstanding=1, deps=[acc1, a1, xs])
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1])

            _store_tile(acc0, acc1, x_bufs, off_m, off_n, tile, b_ptr, out_ptr, ws_ptr, wsi_ptr,
                        cnt_ptr, M, N, stride_om, n_splits, BLOCK_M, NUM_WG, HAS_BIAS, ONE_SPLIT,
                        2)  # fmt: skip
        else:
            acc = gl.zeros([BNW, BLOCK_M], gl.float32, layout=mma)
            for j in range(gl.maximum(n_steps // 2, 1)):
                i = 2 * j
                s = i % S
                mbarrier.wait(ready.index(s), (i // S) & 1)
                xs = x_bufs.index(s).permute((1, 0))  # [64, BLOCK_M]
                w_st = reinterpret(w_bufs.index(s), gl.bfloat16, [RW, 32], plain)
                s_st = reinterpret(s_bufs.index(s), gl.bfloat16, [RW, 2], plain)
                z_st = reinterpret(z_bufs.index(s), gl.bfloat16, [RW, 2], plain) if HAS_ZP else s_st
                a0 = _fragment(w_st, s_st, z_st, NUM_WG, BLOCK_M, HAS_ZP)
                acc = warpgroup_mma(a0, xs, acc, is_async=True)
                acc, a0, xs = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a0, xs])
                # step i - 1 has retired: its stage goes back to the producer
                mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
                s1 = (i + 1) % S
                mbarrier.wait(ready.index(s1), ((i + 1) // S) & 1)
                xs1 = x_bufs.index(s1).permute((1, 0))
                w_st1 = reinterpret(w_bufs.index(s1), gl.bfloat16, [RW, 32], plain)
                s_st1 = reinterpret(s_bufs.index(s1), gl.bfloat16, [RW, 2], plain)
                z_st1 = (
                    reinterpret(z_bufs.index(s1), gl.bfloat16, [RW, 2], plain) if HAS_ZP else s_st1
                )
                a1 = _fragment(w_st1, s_st1, z_st1, NUM_WG, BLOCK_M, HAS_ZP)
                acc = warpgroup_mma(a1, xs1, acc, is_async=True)
                acc, a1, xs1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a1, xs1])
                mbarrier.arrive(empty.index(s), count=1)  # step i has retired
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _store_tile(acc, acc, x_bufs, off_m, off_n, tile, b_ptr, out_ptr, ws_ptr, wsi_ptr,
                        cnt_ptr, M, N, stride_om, n_splits, BLOCK_M, NUM_WG, HAS_BIAS, ONE_SPLIT,
                        1)  # fmt: skip

    @gluon.jit
    def kernel(
        x_desc, w_desc, s_desc, z_desc, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
        M, N, kt_per_split, kt_total, stride_om, m_tiles, whole_tiles, tail_splits,
        GROUP_TILES: gl.constexpr,  # K tiles per scale group (0: one scale per column)
        BLOCK_M: gl.constexpr,
        NUM_WG: gl.constexpr,  # consumer warpgroups, each two 64-row slabs
        NUM_STAGES: gl.constexpr,
        HAS_ZP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ONE_SPLIT: gl.constexpr,  # else the serial split-K reduction through ws / cnt
        SLABS: gl.constexpr = 2,  # 64-row slabs a consumer warpgroup (1: BLOCK_M up to 256)
    ):  # fmt: skip
        S: gl.constexpr = NUM_STAGES
        CG: gl.constexpr = 4 * SLABS * NUM_WG  # 16-row column groups a CTA
        # CTAs [0, whole_tiles) take tiles whole; each later group of tail_splits CTAs splits
        # one of the remaining tiles over K. Tiles go M-tile first, so the CTAs that share a
        # column tile's weights run together and read them from DRAM once.
        pid = gl.program_id(0)
        is_tail = (pid >= whole_tiles).to(gl.int32)
        j = gl.maximum(pid - whole_tiles, 0)
        tile = pid + is_tail * (whole_tiles + j // tail_splits - pid)
        kt_lo = is_tail * (j % tail_splits) * kt_per_split
        kt_len = kt_total + is_tail * (kt_per_split - kt_total)
        n_steps = gl.minimum(kt_lo + kt_len, kt_total) - kt_lo
        n_splits = 1 + is_tail * (tail_splits - 1)
        pid_n = tile // m_tiles
        off_m = (tile % m_tiles) * BLOCK_M
        cg0 = pid_n * CG  # SLABS slabs x 4 NUM_WG warps, a column group each
        off_n = pid_n * (SLABS * SL * NUM_WG)

        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_M, BK], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int32, [S, CG, 128], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.int32, [S, CG, 8], s_desc.layout)
        if HAS_ZP:
            z_bufs = gl.allocate_shared_memory(gl.int32, [S, CG, 8], z_desc.layout)
        else:
            z_bufs = s_bufs
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        gl.warp_specialize(
            [
                (_consume, (x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, n_steps, off_m, off_n,
                            tile, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, M, N, stride_om,
                            n_splits, BLOCK_M, NUM_WG, S, HAS_ZP, HAS_BIAS,
                            ONE_SPLIT, SLABS)),
                (_produce, (x_desc, w_desc, s_desc, z_desc, x_bufs, w_bufs, s_bufs, z_bufs,
                            ready, empty, off_m, cg0, kt_lo, n_steps, S, GROUP_TILES, HAS_ZP)),
            ],
            [1],
            [40],
        )  # fmt: skip

    return kernel


def max_regs(warpgroups: int) -> int:
    """The kernel's register cap (`maxnreg`) over its consumer warpgroups and the producer's
    warpgroup: two CTAs an SM with one consumer warpgroup, one with two (64 Ki registers an SM);
    the producer gives back all but 40 a thread to the consumers (`setmaxnreg`)."""
    threads = 128 * (warpgroups + 1) * (2 if warpgroups == 1 else 1)
    return min(255, (65536 // threads) // 8 * 8)


def tile_count(m: int, n: int, block_m: int, wgs: int, slabs: int = 2) -> int:
    return -(-m // block_m) * -(-n // rows_per_cta(wgs, slabs))


def tail_schedule(tiles: int, kt: int, slots: int, split: int) -> tuple[int, int, int]:
    """(whole tiles, CTAs a split tile, K tiles a split CTA) for `split` applied to the tiles
    left after whole waves of `slots` (the SMs): those waves take whole tiles, the rest are
    split over K so that the last wave is full instead of a few CTAs long. Every split CTA
    has a step."""
    rest = tiles % slots if tiles >= slots else tiles
    if split <= 1 or rest == 0:
        return tiles, 1, kt
    per = -(-kt // min(split, kt))
    return tiles - rest, -(-kt // per), per


@functools.lru_cache(maxsize=4096)  # per call of every layer: a pure function of its shape
def default_tma_config(m: int, n: int, k: int, num_sms: int) -> TmaConfig:
    """BLOCK_M the smallest tile that holds M (up to 128; larger M takes several), one
    consumer warpgroup, a 4-stage ring, and the split of the tiles left after whole waves that
    minimizes a wave model of the time in K steps, taken where it saves at least 15 %: waves
    of one CTA an SM (a second resident CTA measured to add little), whole tiles `kt + 3` (the
    ring's fill, the epilogue), split ones `per + 5` (their fp32 partials); at least 4 K steps
    a split, at most 16 splits, no more partial bytes than int4 weight bytes (BENCHMARKS.md,
    W4A16 kernels)."""
    block_m = next((b for b in BLOCK_MS if b >= m), BLOCK_MS[-1])
    wgs, stages = 1, 4
    kt = k // BLOCK_K
    tiles = tile_count(m, n, block_m, wgs)
    waves, rest = divmod(tiles, num_sms)
    unsplit = (waves + (rest > 0)) * (kt + 3)
    best, best_split = unsplit, 1
    piece_bytes = rows_per_cta(wgs) * block_m * 4
    for split in range(2, min(16, kt // 4) + 1):
        per = -(-kt // split)
        used = -(-kt // per)
        if rest * used * piece_bytes > n * k // 2:
            break
        cost = waves * (kt + 3) + -(-rest * used // num_sms) * (per + 5)
        if cost < best:
            best, best_split = cost, used
    if best > 0.85 * unsplit:
        best_split = 1
    return block_m, wgs, best_split, stages


_TUNED = TUNED_DIR / "w4a16_tma.json"


@functools.cache
def _tuned_table(gpu_name: str) -> dict[tuple[int, int, int], list[tuple[int, int, tuple]]]:
    """{(n, k, group): [(min_m, max_m, config), ...]} measured on this GPU model
    (`benchmarks/quant/tma_table.py` from a `bench_w4a16_tc.py --sweep tma` run); empty for
    other GPUs."""
    table: dict[tuple[int, int, int], list[tuple[int, int, tuple]]] = {}
    for e in gpu_entries(_TUNED, gpu_name):
        if e.get("config"):
            key = (e["n"], e["k"], e["group_size"])
            table.setdefault(key, []).append((e["min_m"], e["m"], tuple(e["config"])))
    return table


@functools.lru_cache(maxsize=4096)
def tuned_tma_config(
    gpu_name: str, m: int, n: int, k: int, group_size: int, num_sms: int, zp: bool
) -> TmaConfig | None:
    """The measured best config of the band of swept M holding `m` for this shape on this GPU
    model, if that band has one and it fits (`resolve_config`); None: the heuristic."""
    for lo, hi, config in _tuned_table(gpu_name).get((n, k, group_size), ()):
        if lo <= m <= hi:
            try:
                resolve_config(config, m, n, k, num_sms, zp)
            except ValueError:
                return None
            return config
    return None


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _smem_layouts():
    """The TMA tiles' shared layouts: activations (128-byte swizzle, bf16), words and pairs
    (no swizzle, 32-bit)."""
    from triton.experimental.gluon import language as gl

    return (
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
    )


def compile_sm90(
    block_m: int,
    wgs: int,
    stages: int,
    zp: bool,
    one_split: bool,
    slabs: int = 2,
) -> dict:
    """The kernel compiled for sm_90 without a GPU (Triton's PTX backend runs on the CPU): its
    `asm` dict (PTX, cubin). For code checks; not from a process running the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    xl, fl = _smem_layouts()
    cgs = rows_per_cta(wgs, slabs) // 16
    sig = {"x_desc": f"tensordesc<bf16[{block_m}, 64],{xl!r}>",
           "w_desc": f"tensordesc<i32[{cgs}, 128],{fl!r}>",
           "s_desc": f"tensordesc<i32[{cgs}, 8],{fl!r}>",
           "z_desc": f"tensordesc<i32[{cgs}, 8],{fl!r}>",
           "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "wsi_ptr": "*i32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "kt_per_split": "i32", "kt_total": "i32",
           "stride_om": "i32", "m_tiles": "i32", "whole_tiles": "i32",
           "tail_splits": "i32"}  # fmt: skip
    consts = {"GROUP_TILES": 2, "BLOCK_M": block_m, "NUM_WG": wgs, "NUM_STAGES": stages,
              "HAS_ZP": zp, "HAS_BIAS": False, "ONE_SPLIT": one_split,
              "SLABS": slabs}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (4, 5, 6, 7, 8, 10, 13)}
    src = GluonASTSource(fn=_kernel(), signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4 * wgs, "maxnreg": max_regs(wgs)}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm


def resolve_config(
    config: TmaConfig | None, m: int, n: int, k: int, num_sms: int, zp: bool
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, warpgroups, split, stages, slabs) of `config` (None: the default), checked: a
    ValueError names what the kernel cannot run."""
    block_m, wgs, split, stages, *rest = config or default_tma_config(m, n, k, num_sms)
    if len(rest) > 1:
        raise ValueError(f"config {config}: (BLOCK_M, warpgroups, split, stages[, slabs])")
    slabs = int(rest[0]) if rest else 2
    block_ms = BLOCK_MS if slabs == 2 else ONE_SLAB_BLOCK_MS
    if block_m not in block_ms or wgs not in (1, 2) or slabs not in (1, 2):
        raise ValueError(f"config {config}: BLOCK_M in {block_ms}, 1 or 2 warpgroups, 1 or 2 slabs")
    if block_m > 128 and wgs == 1:  # a 64 x 256 fp32 accumulator: 128 registers of 128
        raise ValueError(f"config {config}: BLOCK_M 256 needs two warpgroups (registers)")
    if stages < 2 * wgs or smem_bytes(block_m, wgs, stages, zp, slabs) > SMEM_BYTES:
        raise ValueError(
            f"config {config}: at least {2 * wgs} stages (the epilogue's staging) and within "
            f"{SMEM_BYTES} bytes of shared memory"
        )
    if slabs == 1 and (k // BLOCK_K) % 2:
        raise ValueError(f"config {config}: one slab a warpgroup needs an even K / 64, got {k}")
    return block_m, wgs, split, stages, slabs


def wna16_wgmma_tma(
    x: torch.Tensor,  # [M, K] bf16, CUDA, sm_90
    words: torch.Tensor,  # `repack_mma`
    scale_pairs: torch.Tensor,  # `repack_mma_scales` [N / 16, groups, 8] int32
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    zero_pairs: torch.Tensor | None = None,  # `repack_mma_zeros` (None: symmetric, z = 8)
    workspace: SplitKWorkspace | None = None,  # split-K scratch (None: no split-K)
    config: TmaConfig | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """y = x @ dequant(W).T (+ bias) for W stored by `repack_mma`, W = (u - z) * s per group."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from pagoda.kernels.wna16.gluon_mma_wgmma import check_inputs, split_k_scratch

    m, k = x.shape
    supported = tma_supported(n, k, group_size)
    check_inputs("wna16_wgmma_tma", x, n, group_size, bias, supported, "N % 16 == 0")
    num_sms = platform.num_sms(x.device)
    zp = zero_pairs is not None
    kt_total = k // BLOCK_K
    if config is None:
        name = _gpu_name(x.device.index if x.device.index is not None else 0)
        config = tuned_tma_config(name, m, n, k, group_size, num_sms, zp)
    block_m, wgs, split, stages, slabs = resolve_config(config, m, n, k, num_sms, zp)
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    if x.stride(1) != 1 or x.stride(0) % 8:
        x = x.contiguous()
    if x.data_ptr() % 16:  # a view at an odd offset: TMA needs a 16-byte aligned base
        x = x.clone(memory_format=torch.contiguous_format)
    rows = rows_per_cta(wgs, slabs)
    tiles = tile_count(m, n, block_m, wgs, slabs)
    whole, split, per = tail_schedule(tiles, kt_total, num_sms, split)
    if slabs == 1 and per % 2:  # two K steps a loop trip: every CTA an even count
        per += 1
        split = -(-kt_total // per)
        whole = tiles if split == 1 else whole
    ws, cnt, per, grid = split_k_scratch(workspace, out, words, (tiles, 1, split), per, kt_total)
    if grid[2] == 1:  # no workspace to split with
        whole, split = tiles, 1
    ncg, groups = n // 16, scale_pairs.shape[1]
    x_layout, flat = _smem_layouts()
    x_desc = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K], x_layout)
    w_desc = TensorDescriptor.from_tensor(words.view(ncg, kt_total * 128), [rows // 16, 128], flat)
    s_desc = TensorDescriptor.from_tensor(scale_pairs.view(ncg, groups * 8), [rows // 16, 8], flat)
    z_desc = s_desc
    if zp:
        z_flat = zero_pairs.view(ncg, groups * 8)
        z_desc = TensorDescriptor.from_tensor(z_flat, [rows // 16, 8], flat)
    per_channel = group_size <= 0 or group_size >= k
    _kernel()[(whole + (tiles - whole) * split,)](
        x_desc, w_desc, s_desc, z_desc, bias if bias is not None else out, out, ws,
        ws.view(torch.int32), cnt, m, n, per, kt_total, out.stride(0), -(-m // block_m), whole,
        split,
        GROUP_TILES=0 if per_channel else group_size // BLOCK_K,
        BLOCK_M=block_m,
        NUM_WG=wgs,
        NUM_STAGES=stages,
        HAS_ZP=zp,
        HAS_BIAS=bias is not None,
        ONE_SPLIT=split == 1,
        SLABS=slabs,
        num_warps=4 * wgs,
        maxnreg=max_regs(wgs),
    )  # fmt: skip
    return out

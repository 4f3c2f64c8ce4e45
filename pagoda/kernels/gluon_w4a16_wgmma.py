"""W4A16 GEMM on Hopper `wgmma` with the dequantized weight as the register (A) operand, in Gluon.

Swap-AB: out^T [N, M] = W [N, K] x^T [K, M], so a warpgroup's 64 weight rows are the MMA's M and
the batch (8-256 rows) its N; the activation tile is the shared-memory B operand. Triton's
`tl.dot` cannot be told to keep a computed operand in registers (it stages the dequantized tile
through shared memory, session 9's PTX); Gluon states layouts: each thread loads exactly the
words whose nibbles make up its A fragment, unpacks them, and the join / reshape / permute that
orders the nibbles yields a layout equal to the fragment's, so the `convert_layout` to it is free
(no shared memory, no shuffles: checked in the PTX for sm_90).

Pipeline, per program: a ring of NUM_STAGES shared-memory stages, each the packed words of the
program's 64-row blocks for one K step (2 KB per warpgroup) and the activation tile [BLOCK_M, 64]
(NVMMA layout, read by the MMA straight from the ring), filled by cp.async (rows past M
zero-filled). The weight words run NUM_STAGES - 1 steps ahead, the activations NUM_STAGES - 2
(one stage is still read by the MMA in flight). A thread reads its A fragment from its stage in
two 8-byte loads (conflict-free); the MMA is asynchronous, one left in flight over the next
step's unpacking. Dequantization ORs each nibble q into the bits of bf16 128 + q; with bf16
scales it is (128 + q - (128 + z)) * s in bf16 (exact difference, one rounding: the same values
as the fp32 (q - z) * s rounded to bf16; zero points must be integers), else in fp32.

Layout (`repack_wgmma`): blocks of 64 rows x 64 K, stored [N / 64][K / 64][row 0..63][j 0..7]
int32. In a block, with k = 32 h + 16 a + 8 b + 2 c + d (h, a, b, d in {0, 1}, c in 0..3), row r's
nibble k is nibble t = 4 a + 2 b + d of word j = 2 c + h. Lane 4 (r % 8) + c of warp (r % 64) // 16
holds words j = 2c, 2c + 1 of rows r and r + 8: its A fragment for the block's four K = 16 MMAs.

The kernel runs on sm_90 only (wgmma); `unpack_wgmma` is the torch mirror of its unpacking
(the CPU oracle of the layout), the GPU tests compare the kernel with the dequantized matmul.
"""

from __future__ import annotations

import functools

import torch

BLOCK_N = 64  # weight rows per program: one warpgroup's wgmma M
BLOCK_K = 64  # K per packed block and per loop step
MAX_BLOCK_M = 256  # the largest wgmma N


def wgmma_supported(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel takes: whole 64 x 64 blocks, groups of whole blocks (or per-channel)."""
    per_channel = group_size <= 0 or group_size >= k
    return n % BLOCK_N == 0 and k % BLOCK_K == 0 and (per_channel or group_size % BLOCK_K == 0)


def _positions(n: int, k: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(word index, nibble) of every (row, K) element, [N, K] each."""
    r = torch.arange(n, device=device).view(n, 1)
    kk = torch.arange(k, device=device).view(1, k)
    nb, rr = r // BLOCK_N, r % BLOCK_N
    kt, kr = kk // BLOCK_K, kk % BLOCK_K
    h, a, b = kr // 32, (kr // 16) % 2, (kr // 8) % 2
    c, d = (kr % 8) // 2, kr % 2
    j = 2 * c + h
    word = ((nb * (k // BLOCK_K) + kt) * BLOCK_N + rr) * 8 + j
    return word, 4 * a + 2 * b + d


def repack_wgmma(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, any integer dtype) -> int32 words [N * K / 8] in the wgmma layout."""
    n, k = codes.shape
    if not wgmma_supported(n, k, -1):
        raise ValueError(f"repack_wgmma needs N and K multiples of 64, got {n} x {k}")
    word, nib = _positions(n, k, codes.device)
    vals = codes.to(torch.int64) << (4 * nib)
    out = torch.zeros(n * k // 8, dtype=torch.int64, device=codes.device)
    out.index_add_(0, word.reshape(-1), vals.reshape(-1))
    out = torch.where(out >= 2**31, out - 2**32, out)  # two's complement into int32
    return out.to(torch.int32)


def unpack_wgmma(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's unpacking in torch: words -> codes [N, K] int32, by the same shifts, joins
    (torch.stack on a new last dim), reshapes and permutes, block by block."""
    w = words.view(n // BLOCK_N, k // BLOCK_K, BLOCK_N, 8).to(torch.int64) & 0xFFFFFFFF
    q = [(w >> (4 * t)) & 0xF for t in range(8)]
    p = [torch.stack((q[2 * i], q[2 * i + 1]), -1) for i in range(4)]  # d
    r = [torch.stack((p[0], p[1]), -1), torch.stack((p[2], p[3]), -1)]  # b
    t = torch.stack((r[0], r[1]), -1)  # [..., 64 rows, 8 j, d, b, a]
    t = t.reshape(*t.shape[:3], 4, 2, 2, 2, 2)  # rows, c, h, d, b, a
    t = t.permute(0, 1, 2, 4, 7, 6, 3, 5)  # rows, h, a, b, c, d
    t = t.reshape(n // BLOCK_N, k // BLOCK_K, BLOCK_N, BLOCK_K)
    return t.permute(0, 2, 1, 3).reshape(n, k).to(torch.int32)


@functools.cache
def gluon_available() -> bool:
    """Gluon with Hopper's warpgroup MMA importable (Triton >= 3.5)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


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

    @constexpr_function
    def word_layout(num_wg):
        """Words [64 num_wg rows, 8 j]: lane 4 (r % 8) + c holds j = 2c, 2c + 1 of rows r, r + 8
        in warp r // 16 (the A fragments of `repack_wgmma`'s blocks)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0]],
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16 << i, 0] for i in range(2 + (num_wg - 1).bit_length())],
            block_bases=[],
            shape=[64 * num_wg, 8],
        )

    @gluon.jit
    def kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
        M, N, K, kt_per_split, stride_xm, stride_om, stride_os,
        GROUP_TILES: gl.constexpr,  # K blocks per scale group (0: one scale per row)
        BLOCK_M: gl.constexpr,
        NUM_WG: gl.constexpr,  # warpgroups, each 64 weight rows sharing the activation tile
        NUM_STAGES: gl.constexpr,  # ring depth (>= 3)
        HAS_ZP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ONE_SPLIT: gl.constexpr,  # else fp32 partials [split, M, N] summed by the caller
    ):  # fmt: skip
        BN: gl.constexpr = 64 * NUM_WG
        S: gl.constexpr = NUM_STAGES
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4 * NUM_WG, 1], instr_shape=[16, BLOCK_M, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_l: gl.constexpr = word_layout(NUM_WG)
        # the copies: 16 bytes a thread (4 words of a row; 8 activations of a row)
        wc_l: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 4],
            threads_per_warp=[16, 2],
            warps_per_cta=[4 * NUM_WG, 1],
            order=[1, 0],
        )
        xc_l: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 8],
            threads_per_warp=[4, 8],
            warps_per_cta=[4 * NUM_WG, 1],
            order=[1, 0],
        )
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        kt_total = K // 64
        kt_lo = pid_k * kt_per_split
        kt_hi = gl.minimum(kt_lo + kt_per_split, kt_total)

        wr = gl.arange(0, BN, layout=gl.SliceLayout(1, wc_l))
        wj = gl.arange(0, 8, layout=gl.SliceLayout(0, wc_l))
        w_rows = w_ptr + pid_n.to(gl.int64) * NUM_WG * kt_total * 512
        # row r of the program: 64-row block r // 64 (blocks are kt_total * 512 words apart)
        w_off = gl.expand_dims((wr // 64) * (kt_total * 512) + (wr % 64) * 8, 1)
        w_ptrs = w_rows + w_off + gl.expand_dims(wj, 0)  # + kt * 512
        x_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xc_l))
        x_k = gl.arange(0, 64, layout=gl.SliceLayout(0, xc_l))
        x_mask = gl.expand_dims(x_m < M, 1)
        x_ptrs = x_ptr + gl.expand_dims(x_m, 1) * stride_xm + gl.expand_dims(x_k, 0)
        s_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, a_l))
        w_smem = gl.allocate_shared_memory(gl.int32, [S, BN, 8], w_sl)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_M, 64], x_sl)
        acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma)

        # cp.async ring of S stages, one commit group per operand and step, in the order
        # W(0), X(0), W(1), X(1), W(2), ...: step kt's weights are issued S - 1 steps ahead,
        # its activations S - 2 (their stage is the one the MMA still in flight may read).
        # The loop runs in pairs of steps (so consecutive MMAs' A operands are distinct
        # registers, which ptxas needs to keep one in flight); steps past the split's end
        # reload its last weight block and a zero activation tile, adding nothing.
        async_load(w_smem.index(0), w_ptrs + kt_lo * 512)
        async_copy.commit_group()
        for p in gl.static_range(S - 2):
            kx = gl.minimum(kt_lo + p, kt_hi - 1)
            async_load(x_smem.index(p), x_ptrs + kx * 64, mask=x_mask & (kt_lo + p < kt_hi))
            async_copy.commit_group()
            kw = gl.minimum(kt_lo + p + 1, kt_hi - 1)
            async_load(w_smem.index(p + 1), w_ptrs + kw * 512)
            async_copy.commit_group()
        # every split has a step (the caller's split); the compiler must see the loop run, as
        # a zero-trip path (acc set apart from the MMAs) makes ptxas serialize them
        pairs = gl.maximum((kt_hi - kt_lo + 1) // 2, 1)
        for pair in range(pairs):
            for u in gl.static_range(2):
                kt = kt_lo + 2 * pair + u
                i = kt - kt_lo
                # X(kt) has landed when at most W(kt + 1) and S - 3 later pairs are pending
                async_copy.wait_group(2 * S - 5)
                barrier()
                fence_async_shared()  # the copies (generic proxy) before the MMA (async proxy)
                # every warpgroup has retired step kt - 2's MMA (its wait below, last step), so
                # X(kt + S - 2) may overwrite that stage; a weight stage is free once loaded
                kx = kt + S - 2
                async_load(
                    x_smem.index((i + S - 2) % S),
                    x_ptrs + gl.minimum(kx, kt_hi - 1) * 64,
                    mask=x_mask & (kx < kt_hi),
                )
                async_copy.commit_group()
                kw = gl.minimum(kt + S - 1, kt_hi - 1)
                async_load(w_smem.index((i + S - 1) % S), w_ptrs + kw * 512)
                async_copy.commit_group()

                words = w_smem.index(i % S).load(w_l)
                q0 = (words & 0xF) | 0x4300  # bf16 bits of 128 + nibble
                q1 = ((words >> 4) & 0xF) | 0x4300
                q2 = ((words >> 8) & 0xF) | 0x4300
                q3 = ((words >> 12) & 0xF) | 0x4300
                q4 = ((words >> 16) & 0xF) | 0x4300
                q5 = ((words >> 20) & 0xF) | 0x4300
                q6 = ((words >> 24) & 0xF) | 0x4300
                q7 = ((words >> 28) & 0xF) | 0x4300
                r0 = gl.join(gl.join(q0, q1), gl.join(q2, q3))  # [BN, 8, d, b]
                r1 = gl.join(gl.join(q4, q5), gl.join(q6, q7))
                t = gl.join(r0, r1)  # [BN rows, 8 j, d, b, a]
                t = gl.reshape(t, [BN, 4, 2, 2, 2, 2])  # rows, c, h, d, b, a
                t = gl.permute(t, [0, 2, 5, 4, 1, 3])  # rows, h, a, b, c, d
                q = gl.convert_layout(gl.reshape(t, [BN, 64]), a_l)
                if GROUP_TILES > 0:
                    grp = gl.minimum(kt, kt_hi - 1) // GROUP_TILES
                else:
                    grp = 0
                q = q.to(gl.int16).to(gl.bfloat16, bitcast=True)
                if HAS_ZP:
                    z = gl.load(z_ptr + grp * N + s_n) + 128.0
                else:
                    z = gl.full([BN], 136.0, gl.float32, layout=gl.SliceLayout(1, a_l))
                s = gl.load(s_ptr + grp * N + s_n)
                if s_ptr.dtype.element_ty == gl.bfloat16:
                    # (128 + q) - (128 + z) is exact, and so one rounding of its product with s,
                    # the same as the fp32 path's
                    w = (q - gl.expand_dims(z.to(gl.bfloat16), 1)) * gl.expand_dims(s, 1)
                else:
                    w = (q.to(gl.float32) - gl.expand_dims(z, 1)) * gl.expand_dims(s, 1)
                    w = w.to(gl.bfloat16)
                xs = x_smem.index(i % S)
                acc = warpgroup_mma(w, xs.permute((1, 0)), acc, is_async=True)
                # one MMA stays in flight (over the next step's unpacking); `w` stays live with it
                acc, w, xs = warpgroup_mma_wait(num_outstanding=1, deps=[acc, w, xs])
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)

        o_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        o_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        o_mask = gl.expand_dims(o_m < M, 0)
        if ONE_SPLIT:
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(b_ptr + o_n).to(gl.float32), 1)
            ptrs = out_ptr + gl.expand_dims(o_m, 0) * stride_om + gl.expand_dims(o_n, 1)
            gl.store(ptrs, acc.to(gl.bfloat16), mask=o_mask)
        else:
            ptrs = (
                out_ptr + pid_k * stride_os + gl.expand_dims(o_m, 0) * stride_om
                + gl.expand_dims(o_n, 1)
            )  # fmt: skip
            gl.store(ptrs, acc, mask=o_mask)

    return kernel


WgmmaConfig = tuple[int, int, int, int]  # BLOCK_M, warpgroups (64 rows each), split-K, stages
SMEM_BYTES = 227 * 1024  # sm_90's shared memory per block


def wgmma_smem_bytes(block_m: int, wgs: int, stages: int) -> int:
    """The ring: per stage an activation tile (bf16) and the warpgroups' 2 KB weight blocks."""
    return stages * (block_m * BLOCK_K * 2 + wgs * BLOCK_N * 8 * 4)


def default_wgmma_config(m: int, n: int, k: int, num_sms: int) -> WgmmaConfig:
    """The smallest wgmma N that holds M (8-256); two warpgroups share each activation tile
    from M = 64 on (x is read from L2 once per program); split-K until the SMs are full;
    a 4-stage ring (144 KB at BLOCK_M 256)."""
    block_m = 8
    while block_m < min(m, MAX_BLOCK_M):
        block_m *= 2
    wgs = 2 if block_m >= 64 and n % (2 * BLOCK_N) == 0 else 1
    programs = -(-m // block_m) * (n // (BLOCK_N * wgs))
    split = max(1, min(8, round(num_sms / programs))) if programs < num_sms else 1
    return block_m, wgs, split, 4


def wna16_wgmma_gemm(
    x: torch.Tensor,  # [M, K] bf16, CUDA, sm_90
    words: torch.Tensor,  # `repack_wgmma`
    scales_t: torch.Tensor,  # [groups, N] (bf16 or fp32)
    n: int,
    group_size: int,
    zeros_t: torch.Tensor | None = None,  # [groups, N] integer zero points (None: 8)
    bias: torch.Tensor | None = None,
    config: WgmmaConfig | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """y = x @ dequant(W).T (+ bias), W = (codes - z) * s per group."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or not x.is_cuda or not wgmma_supported(n, k, group_size):
        raise ValueError(
            f"wna16_wgmma_gemm takes CUDA bf16 x and whole 64 x 64 blocks, got {x.dtype} on "
            f"{x.device}, N={n} K={k} group={group_size}"
        )
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    block_m, wgs, split, stages = config or default_wgmma_config(m, n, k, num_sms)
    if n % (BLOCK_N * wgs):
        raise ValueError(f"N={n} is not a multiple of {BLOCK_N * wgs} rows ({wgs} warpgroups)")
    if stages < 3 or wgmma_smem_bytes(block_m, wgs, stages) > SMEM_BYTES:
        raise ValueError(f"{stages} stages: at least 3, and within {SMEM_BYTES} bytes")
    kt_total = k // BLOCK_K
    per = -(-kt_total // split)
    per += per % 2 if split > 1 else 0  # whole pairs of steps (the loop's unit) per split
    split = -(-kt_total // per)
    per_channel = group_size <= 0 or group_size >= k
    if x.stride(1) != 1:
        x = x.contiguous()
    s = scales_t.contiguous()
    z = zeros_t.to(torch.float32).contiguous() if zeros_t is not None else s
    if split == 1:
        out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
        stride_os = 0
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
        stride_os = out.stride(0)
    grid = (n // (BLOCK_N * wgs), -(-m // block_m), split)
    _kernel()[grid](
        x, words, s, z, bias if bias is not None else x, out,
        m, n, k, per, x.stride(0), out.stride(-2), stride_os,
        GROUP_TILES=0 if per_channel else group_size // BLOCK_K,
        BLOCK_M=block_m,
        NUM_WG=wgs,
        NUM_STAGES=stages,
        HAS_ZP=zeros_t is not None,
        HAS_BIAS=bias is not None and split == 1,
        ONE_SPLIT=split == 1,
        num_warps=4 * wgs,
    )  # fmt: skip
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(torch.bfloat16)

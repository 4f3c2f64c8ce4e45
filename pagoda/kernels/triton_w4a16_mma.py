"""W4A16 GEMV on tensor cores: int4 -> bf16x2 in registers, then `mma.sync` (M <= 8).

Why: the FMA GEMV (`triton_w4a16.wna16_gemv`) spends a mask-and-OR, a float subtract and an FMA
per weight on the FP32 pipes; streaming int4 at the H200's ~4.2 TB/s is 8.4 T weights/s, which
those three instructions per weight cannot keep up with (it reads at ~44 % of the bandwidth).
Here a weight costs ~1.4 instructions and the multiply-add runs on the tensor cores:

- per 32-bit word (8 weights): 3 shifts and 4 `lop3` turn the nibbles into four bf16x2 values
  128 + u (the exponent of 128 makes the 4-bit code the low mantissa bits, exactly), and four
  `fma.rn.bf16x2` subtract 128 + 8: the signed code, exact;
- `mma.sync.m16n8k16` multiplies 16 weight columns x 16 K by 8 activation rows (M <= 8; for
  M = 1 the other 7 columns of the MMA are zero) into fp32;
- the group scale multiplies each tile's fp32 partial (64 K) once per output.

Triton has no way to place a tensor in an MMA fragment, so the weights are repacked once at load
into the order in which the threads of a warp hold the MMA's A fragments, and the MMA is issued
from `tl.inline_asm_elementwise`: every thread runs the same asm on its own 4 words, which is
exactly the warp-wide collective `mma.sync` expects. That relies on how Triton lays out a
[ROWS, 128] int32 tile loaded contiguously along its last dimension (16 B per thread, 32 threads
along the row, warps down the rows): thread `lane` of a warp holds elements 4*lane ... 4*lane+3
of a row. The sm_90 TTGIR of the kernel shows that layout (Triton 3.9; see the notes in
`docs/architecture.md`), `mma_gemv_self_test` checks it on the GPU once per process, and a
mismatch disables this path (the FMA GEMV takes over).

Layout (`repack_mma`): a tile is 16 output columns x 64 K = 128 int32 words; tiles are stored
[N / 16][K / 64] (K fastest), each as [lane 0..31][v 0..3] words. Lane = 4 g + c (the MMA's
groupID g and thread-in-group c); word v of lane (g, c) feeds the v-th MMA of the tile. Within
MMA v, thread c's K slots 2c, 2c+1 hold real K 16c + 2v + {0, 1} and slots 2c+8, 2c+9 hold
16c + 8 + 2v + {0, 1}, so each thread reads 32 contiguous bytes of x per tile. The word's 8
nibbles, low to high: (row g, kA), (row g+8, kA), (row g, kB), (row g+8, kB), then the same for
kA+1, kB+1 in the high half-word (kA = 16c + 2v, kB = kA + 8, rows = tile columns). Shifting by
0, 4, 8, 12 and masking 0x000F000F gives the fragments a0a1, a2a3, a4a5, a6a7.

The torch reference `mma_gemv_emulate` follows the same fragment rules step by step (the CPU
tests check the repacking against the plain dequantized matmul with it), and
`wna16_linear_ref` is the numerical oracle on the GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.pdl import pdl_launch_args

TILE_N = 16  # output columns per tile (the MMA's M)
TILE_K = 64  # K per tile (four MMAs of K = 16)
MAX_M = 8  # activation rows (the MMA's N)
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
    # col = ng*16 + h*8 + g ; k = kb*64 + c*16 + half*8 + v*2 + e
    u = u.view(n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # ng, h, g, kb, c, half, v, e
    u = u.permute(0, 3, 2, 4, 6, 7, 5, 1)  # ng, kb, g, c, v, e, half, h
    u = u.reshape(-1, 8)  # nibble i = 4e + 2half + h at bits 4i
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * 4
    words = (u << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def unpack_mma(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `repack_mma`: the codes [N, K] as uint8."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    u = (words.view(-1, 1) >> shifts) & 0xF  # [tiles*128, 8]
    u = u.view(n // 16, k // 64, 8, 4, 4, 2, 2, 2)  # ng, kb, g, c, v, e, half, h
    u = u.permute(0, 7, 2, 1, 3, 6, 4, 5)  # ng, h, g, kb, c, half, v, e
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
                        ka = kb * 64 + 16 * c + 2 * v
                        kb_ = ka + 8
                        b[2 * c, g], b[2 * c + 1, g] = xb[g, ka], xb[g, ka + 1]
                        b[2 * c + 8, g], b[2 * c + 9, g] = xb[g, kb_], xb[g, kb_ + 1]
                d += a @ b
            grp = kb * TILE_K // group
            cols = torch.arange(16) + ng * 16
            out[:, cols] += (d * s[grp, cols][:, None]).t()
    return out[:m]


# The per-thread asm: 4 words (pack = 4), 4 int32 of x pairs for slots 2c, 2c+1 (xa) and
# 4 for slots 2c+8, 2c+9 (xb), one per MMA v; out: the 4 fp32 accumulators (c0..c3) of the
# tile, from zero.
_ASM = """
{
.reg .b32 a0, a1, a2, a3, t, one, off;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
mov.b32 $0, 0;
mov.b32 $1, 0;
mov.b32 $2, 0;
mov.b32 $3, 0;
""" + "".join(
    f"""
lop3.b32 a0, ${4 + v}, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 4;
lop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 8;
lop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, ${4 + v}, 12;
lop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 a0, a0, one, off;
fma.rn.bf16x2 a1, a1, one, off;
fma.rn.bf16x2 a2, a2, one, off;
fma.rn.bf16x2 a3, a3, one, off;
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{${8 + v}, ${12 + v}}}, {{$0, $1, $2, $3}};
"""
    for v in range(4)
) + "}"
_ASM = tl.constexpr(_ASM)
_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 12))


@triton.jit
def _tile_mma(words, xa, xb, INTERPRET: tl.constexpr):
    """[R, 128] words / x pairs -> [R, 128] fp32 accumulators (bit patterns in int32 on the
    GPU). Under the Triton interpreter (no PTX) the same tile product, written with reshapes:
    the CPU tests run the kernel's bookkeeping with it."""
    if INTERPRET:
        R: tl.constexpr = words.shape[0]
        sh = tl.arange(0, 8) * 4
        q = ((words[:, :, None] >> sh[None, None, :]) & 0xF).to(tl.float32) - 8.0  # [R,128,8]
        q = tl.reshape(q, [R, 8, 4, 4, 2, 2, 2])  # g, c, v, e, half, h
        w = tl.reshape(tl.permute(q, (0, 6, 1, 2, 5, 3, 4)), [R, 16, 64])  # (h g), (c half v e)
        ja = tl.join((xa << 16).to(tl.float32, bitcast=True), (xa & -65536).to(tl.float32, bitcast=True))
        jb = tl.join((xb << 16).to(tl.float32, bitcast=True), (xb & -65536).to(tl.float32, bitcast=True))
        xx = tl.reshape(tl.join(ja, jb), [R, 8, 4, 4, 2, 2])  # n, c, v, e, half
        xx = tl.reshape(tl.permute(xx, (0, 2, 5, 3, 4, 1)), [R, 64, 8])  # (c half v e), n
        d = tl.sum(w[:, :, :, None] * xx[:, None, :, :], axis=2)  # [R, 16, 8]
        d = tl.permute(tl.reshape(d, [R, 2, 8, 4, 2]), (0, 2, 3, 1, 4))  # g, c, h, e
        return tl.reshape(d, [R, 128]).to(tl.int32, bitcast=True)
    else:
        return tl.inline_asm_elementwise(
            _ASM, _CONSTRAINTS, [words, xa, xb], dtype=tl.int32, is_pure=True, pack=4
        )


@triton.jit
def _w4_mma_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, kb_per_split,
    stride_xm, stride_sg, stride_om,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    CG: tl.constexpr,  # column groups (16 columns each) per program
    KT: tl.constexpr,  # K tiles per column group and iteration
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    ATOMIC: tl.constexpr,  # split-K: fp32 atomics into out (zeroed by the caller)
    PREFETCH: tl.constexpr,  # load the first weights before waiting on the previous kernel
    USE_PDL: tl.constexpr,
):  # fmt: skip
    ROWS: tl.constexpr = CG * KT
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, 128)[None, :]
    cg = r // KT
    kt = r % KT
    lane = j // 4
    v = j % 4
    g = lane // 4
    c = lane % 4
    ng = pid_n * CG + cg  # [ROWS, 1] column group
    kb_total = K // 64
    kb_start = pid_k * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, kb_total)
    n_groups = N // 16
    row_ok = ng < n_groups
    col = ng * 16 + g + 8 * (v // 2)  # [ROWS, 128] the output column of accumulator v
    x_ok = g < M  # lanes past M feed zero rows of B
    w_rows = w_ptr + (ng * kb_total) * 128 + j  # + kb * 128
    x_base = x_ptr + g * stride_xm + 8 * c + v  # int32 pairs; + kb * 32

    kb = kb_start + kt
    ok = row_ok & (kb < kb_end)
    if PREFETCH:
        words = tl.load(w_rows + kb * 128, mask=ok, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if not PREFETCH:
        words = tl.load(w_rows + kb * 128, mask=ok, other=0)
    acc = tl.zeros([ROWS, 128], dtype=tl.float32)
    for kb0 in range(kb_start, kb_end, KT):
        kb = kb0 + kt
        ok = row_ok & (kb < kb_end)
        kb_next = kb + KT
        ok_next = row_ok & (kb_next < kb_end)
        words_next = tl.load(w_rows + kb_next * 128, mask=ok_next, other=0)
        xa = tl.load(x_base + kb * 32, mask=ok & x_ok, other=0)
        xb = tl.load(x_base + kb * 32 + 4, mask=ok & x_ok, other=0)
        d = _tile_mma(words, xa, xb, INTERPRET).to(tl.float32, bitcast=True)
        if GROUP_TILES > 0:
            scale = tl.load(s_ptr + (kb // GROUP_TILES) * stride_sg + col, mask=ok, other=0.0)
            acc += d * scale.to(tl.float32)
        else:
            acc += d
        words = words_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    total = tl.sum(tl.reshape(acc, [CG, KT, 128]), axis=1)  # [CG, 128]
    cg2 = tl.arange(0, CG)[:, None]
    j2 = tl.arange(0, 128)[None, :]
    lane2 = j2 // 4
    v2 = j2 % 4
    col2 = (pid_n * CG + cg2) * 16 + lane2 // 4 + 8 * (v2 // 2)
    m2 = 2 * (lane2 % 4) + v2 % 2
    ok2 = (m2 < M) & (col2 < N)
    if GROUP_TILES == 0:
        total *= tl.load(s_ptr + col2, mask=ok2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        if pid_k == 0:
            total += tl.load(b_ptr + col2, mask=ok2, other=0.0).to(tl.float32)
    if ATOMIC:
        tl.atomic_add(out_ptr + m2 * stride_om + col2, total, mask=ok2, sem="relaxed")
    else:
        tl.store(out_ptr + m2 * stride_om + col2, total.to(out_ptr.dtype.element_ty), mask=ok2)


@triton.jit
def _w4_mma_gemv_sk_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, total_steps, steps_per_group,
    stride_xm, stride_sg, stride_om,
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    KT: tl.constexpr,  # K tiles per step (rows of the [KT, 128] word tile)
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Stream-K: the (column group, K step) sequence [N/16][cdiv(K/64, KT)] is cut into equal
    contiguous ranges, one per program; a program streams its range with the next step's
    words, scales and activations in flight, and flushes a column group's sum when it leaves
    it: stored directly when it covered the whole group, else added to an fp32 workspace, the
    last contributor (counted in tiles per group) storing the result and re-zeroing."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per = total_steps // nprog
    rem = total_steps % nprog
    s_begin = pid * per + tl.minimum(pid, rem)
    s_end = s_begin + per + (pid < rem).to(tl.int32)
    kb_total = K // 64
    r = tl.arange(0, KT)[:, None]
    j = tl.arange(0, 128)[None, :]
    v = j % 4
    g = j // 16
    c = (j // 4) % 4
    x_ok = g < M
    x_lane = x_ptr + g * stride_xm + 8 * c + v  # int32 pairs; + kb * 32
    col_in = g + 8 * (v // 2)  # [1, 128] the accumulator's column within its group

    # step s -> group s // steps_per_group, tiles kb = (s % steps_per_group) * KT + r
    ng = s_begin // steps_per_group
    kb = (s_begin % steps_per_group) * KT + r
    ok = kb < tl.where(s_begin < s_end, kb_total, 0)
    words = tl.load(w_ptr + (ng * kb_total + kb) * 128 + j, mask=ok, other=0)
    if GROUP_TILES > 0:
        scale = tl.load(s_ptr + (kb // GROUP_TILES) * stride_sg + ng * 16 + col_in, mask=ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    xa = tl.load(x_lane + kb * 32, mask=ok & x_ok, other=0)
    xb = tl.load(x_lane + kb * 32 + 4, mask=ok & x_ok, other=0)
    acc = tl.zeros([KT, 128], dtype=tl.float32)
    for s in range(s_begin, s_end):
        s1 = s + 1
        ng1 = s1 // steps_per_group
        kb1 = (s1 % steps_per_group) * KT + r
        ok1 = kb1 < tl.where(s1 < s_end, kb_total, 0)
        words1 = tl.load(w_ptr + (ng1 * kb_total + kb1) * 128 + j, mask=ok1, other=0)
        if GROUP_TILES > 0:
            scale1 = tl.load(
                s_ptr + (kb1 // GROUP_TILES) * stride_sg + ng1 * 16 + col_in, mask=ok1, other=0.0
            )
        xa1 = tl.load(x_lane + kb1 * 32, mask=ok1 & x_ok, other=0)
        xb1 = tl.load(x_lane + kb1 * 32 + 4, mask=ok1 & x_ok, other=0)
        d = _tile_mma(words, xa, xb, INTERPRET).to(tl.float32, bitcast=True)
        if GROUP_TILES > 0:
            acc += d * scale.to(tl.float32)
        else:
            acc += d
        ng = s // steps_per_group
        if (s1 == s_end) | (ng1 != ng):  # leaving group ng: flush
            part = tl.sum(acc, axis=0)  # [128]
            acc = tl.zeros([KT, 128], dtype=tl.float32)
            jj = tl.arange(0, 128)
            vv = jj % 4
            col = ng * 16 + jj // 16 + 8 * (vv // 2)
            m = 2 * ((jj // 4) % 4) + vv % 2
            okm = m < M
            if GROUP_TILES == 0:
                part *= tl.load(s_ptr + col, mask=okm, other=0.0).to(tl.float32)
            first = tl.maximum(s_begin, ng * steps_per_group)
            n_steps = s - first + 1
            if n_steps == steps_per_group:
                if HAS_BIAS:
                    part += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
                tl.store(out_ptr + m * stride_om + col, part.to(out_ptr.dtype.element_ty), mask=okm)
            else:
                tl.atomic_add(ws_ptr + m * N + col, part, mask=okm, sem="relaxed")
                tl.debug_barrier()
                done = tl.atomic_add(cnt_ptr + ng, n_steps, sem="acq_rel") + n_steps
                if done == steps_per_group:
                    bits = tl.atomic_xchg(wsi_ptr + m * N + col, tl.zeros_like(m), mask=okm, sem="relaxed")
                    total = bits.to(tl.float32, bitcast=True)
                    if HAS_BIAS:
                        total += tl.load(b_ptr + col, mask=okm, other=0.0).to(tl.float32)
                    tl.store(out_ptr + m * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=okm)
                    tl.atomic_xchg(cnt_ptr + ng, 0, sem="relaxed")
        words = words1
        xa = xa1
        xb = xb1
        if GROUP_TILES > 0:
            scale = scale1
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def wna16_mma_gemv_sk(
    x: torch.Tensor,  # [M, K] bf16, M <= 8
    words: torch.Tensor,  # repack_mma output
    scales_t: torch.Tensor,  # [groups, N] bf16
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,  # (KT, programs per SM, num_warps)
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    from pagoda.kernels.triton_w4a16 import _serial_workspace

    m, k = x.shape
    if m > MAX_M or x.dtype != torch.bfloat16:
        raise ValueError(f"wna16_mma_gemv takes bf16 x with M <= {MAX_M}, got {x.dtype} M={m}")
    kt, per_sm, warps = config or (8, 4, 4)
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
    kb_total = k // TILE_K
    steps_per_group = -(-kb_total // kt)
    total = (n // TILE_N) * steps_per_group
    nprog = min(total, per_sm * num_sms)
    xk = x if x.stride(1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
    xi = xk.view(torch.int32)
    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    bufs = _serial_workspace(x.device, m * n, n // TILE_N)
    if bufs is None:
        raise RuntimeError("GEMV workspace too small during CUDA-graph capture")
    ws, cnt = bufs
    per_channel = group_size <= 0 or group_size >= k
    _w4_mma_gemv_sk_kernel[(nprog,)](
        xi, words, scales_t, bias if bias is not None else scales_t, out, ws, ws.view(torch.int32), cnt,
        m, n, k, total, steps_per_group,
        xi.stride(0), scales_t.stride(0), out.stride(0),
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        KT=kt,
        HAS_BIAS=bias is not None,
        INTERPRET=_INTERPRET,
        num_warps=warps,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_mma_config(m: int, n: int, k: int, num_sms: int = 132) -> tuple[int, int, int, int]:
    """(CG, KT, split_k, num_warps): aim for ~16 resident warps and >= 32 KB of weights in
    flight per SM (two iterations of 512 B per tile row)."""
    groups = n // TILE_N
    kb_total = k // TILE_K
    cg, kt, warps = 1, 8, 4
    progs = -(-groups // cg)
    split = max(1, min(round(4 * num_sms / progs), kb_total // (2 * kt)))
    return cg, kt, split, warps


def wna16_mma_gemv(
    x: torch.Tensor,  # [M, K] bf16, M <= 8
    words: torch.Tensor,  # repack_mma output
    scales_t: torch.Tensor,  # [groups, N] bf16
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    prefetch: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    m, k = x.shape
    if m > MAX_M or x.dtype != torch.bfloat16:
        raise ValueError(f"wna16_mma_gemv takes bf16 x with M <= {MAX_M}, got {x.dtype} M={m}")
    num_sms = _num_sms(x.device.index or 0)
    cg, kt, split, warps = config or default_mma_config(m, n, k, num_sms)
    kb_total = k // TILE_K
    kb_per = -(-kb_total // split)
    split = -(-kb_total // kb_per)
    xk = x if x.stride(1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
    xi = xk.view(torch.int32) if xk.is_contiguous() else xk.contiguous().view(torch.int32)
    out_dtype = out_dtype or x.dtype
    if split > 1:
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    else:
        out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    per_channel = group_size <= 0 or group_size >= k
    grid = (-(-(n // TILE_N) // cg), split)
    _w4_mma_gemv_kernel[grid](
        xi, words, scales_t, bias if bias is not None else scales_t, out,
        m, n, k, kb_per,
        xi.stride(0), scales_t.stride(0), out.stride(0),
        GROUP_TILES=0 if per_channel else group_size // TILE_K,
        CG=cg, KT=kt,
        HAS_BIAS=bias is not None,
        INTERPRET=_INTERPRET,
        ATOMIC=split > 1,
        PREFETCH=prefetch,
        num_warps=warps,
        **pdl_launch_args(x),
    )  # fmt: skip
    return out if split == 1 else out.to(out_dtype)

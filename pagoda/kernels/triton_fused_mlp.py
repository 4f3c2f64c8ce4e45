"""The decoder's MLP half of a decode step in fewer launches: residual add + RMSNorm, gate_up,
SiLU-and-mul, down_proj. Dense bf16 / fp16 weights at batch 1: one launch; W4A16 at batch 1-8:
two (below).

Unfused, a batch-1 decode step runs four kernels for it (the fused add-RMSNorm, the gate_up GEMV,
SiLU-and-mul, the down GEMV), each paying its launch and ramp-up. Folding the norm into a GEMV's
prologue makes each of its thousands of programs recompute it; here a fixed set of P programs
(about one an SM) does everything, computing it once each:

1. every program adds the residual and takes the RMS statistics of the row (H values from the
   L2); program 0 stores the new residual;
2. phase 1: the intermediate features go to the programs in tasks of BLOCK_I: a task reads
   BLOCK_I gate rows and the BLOCK_I matching up rows, the normalised input recomputed per K
   tile from the (cached) hidden, residual and norm weight; it stores silu(gate) * up into a
   scratch row of I values;
3. a grid barrier (every program must be resident: the launch is cooperative);
4. phase 2: down_proj's output rows go to the programs in tasks of BLOCK_N, each reading the
   whole scratch row (written by other programs: visible through the barrier's acquire).

Each program's tasks run as one flat loop over (task, K tile), so the software pipeline streams
the weights across task boundaries without draining. Rounding follows the unfused kernels step
for step (`triton_fused_ops`: the sum and the normalised row in the model dtype, the gate / up
sums, silu and the product each rounded), so the result equals them up to the order of the fp32
sums. `two_launches` runs phase 1, then phase 2 as a second launch (no barrier): the CPU
interpreter runs programs one after the other, so it checks the barrier with one program only.

W4A16 (`norm_gate_up_silu_w4a16`, gate_up in `triton_w4a16_mma`'s tensor-core layout, 1-8
rows): steps 1 and 2 in one launch of a fixed set of programs (no barrier: each writes the
normalised rows into its own scratch slot, which its MMAs read back in their lane order), and
down_proj keeps its own tensor-core GEMV: two launches instead of four.

Torch reference: `fused_mlp_ref`. Used by `DecoderMLP.fused_decode` when
`DecoderLayer.fused_mlp_decode` is on (off by default until measured on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda import envs, platform
from pagoda.kernels.fused_ops import MAX_HIDDEN
from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.triton_fused_ops import _drop_bits, _round
from pagoda.kernels.triton_w4a16_mma import _INTERPRET, _tile_mma, load_tiles, mma_supported


@triton.jit
def _grid_barrier(bar_ptr, num_programs):
    """Every program waits here until all `num_programs` have arrived. bar_ptr[0] counts the
    arrivals (the last one resets it), bar_ptr[1] is the generation the waiting ones watch, so
    the pair needs no reset between launches (and CUDA-graph replays)."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
    if arrived == num_programs - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
        tl.atomic_add(bar_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(bar_ptr + 1, 0, sem="acquire") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def _fused_mlp_kernel(
    h_ptr, r_ptr, nw_ptr, wgu_ptr, wd_ptr, out_ptr, r_out_ptr, act_ptr, bar_ptr,
    H, INTER, eps, stride_gu, stride_d,
    BLOCK_H: tl.constexpr,  # next power of 2 of H: the norm's statistics in one tile
    BLOCK_I: tl.constexpr,  # intermediate features a phase-1 task (gate and up rows each)
    BLOCK_K: tl.constexpr,  # phase 1's K tile (over H)
    BLOCK_N: tl.constexpr,  # down_proj output rows a phase-2 task
    BLOCK_K2: tl.constexpr,  # phase 2's K tile (over INTER)
    PHASES: tl.constexpr,  # 3: both, with the grid barrier; 1 or 2: that phase alone
    DROP: tl.constexpr,  # `_round` bits of the model dtype
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if PHASES != 2:
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < H
        hs = tl.load(h_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        rs = tl.load(r_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        s = _round(hs + rs, DROP)  # the residual add in the model dtype, as HF does
        if pid == 0:
            tl.store(r_out_ptr + cols, s.to(r_out_ptr.dtype.element_ty), mask=col_ok)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)

        kt_n = tl.cdiv(H, BLOCK_K)
        nt = _task_count(tl.cdiv(INTER, BLOCK_I), pid, num_programs) * kt_n
        acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        for t in tl.range(0, nt, num_stages=NUM_STAGES):
            i, k, mask, last = _task_tile(t, pid, num_programs, kt_n, INTER, H, BLOCK_I, BLOCK_K)
            # the normalised input of this K tile: (h + r) * rstd, rounded, times the weight
            k_ok = k < H
            hk = tl.load(h_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            rk = tl.load(r_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            wk = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            xk = _round(wk * _round(_round(hk + rk, DROP) * rstd, DROP), DROP)
            acc_g += _weight_tile(wgu_ptr, i, k, mask, stride_gu) * xk[None, :]
            acc_u += _weight_tile(wgu_ptr, i + INTER, k, mask, stride_gu) * xk[None, :]
            if last:
                gate = _round(tl.sum(acc_g, axis=1), DROP)
                up = _round(tl.sum(acc_u, axis=1), DROP)
                act = _round(gate / (1.0 + tl.exp(-gate)), DROP)
                act = _round(act * up, DROP).to(act_ptr.dtype.element_ty)
                tl.store(act_ptr + i, act, mask=i < INTER)
                acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    if PHASES == 3:
        _grid_barrier(bar_ptr, num_programs)
    if USE_PDL:  # every program is resident and past its reads of the inputs
        tl.extra.cuda.gdc_launch_dependents()
    if PHASES != 1:
        kt_n2 = tl.cdiv(INTER, BLOCK_K2)
        nt2 = _task_count(tl.cdiv(H, BLOCK_N), pid, num_programs) * kt_n2
        acc = tl.zeros([BLOCK_N, BLOCK_K2], dtype=tl.float32)
        for t in tl.range(0, nt2, num_stages=NUM_STAGES):
            n, k, mask, last = _task_tile(t, pid, num_programs, kt_n2, H, INTER, BLOCK_N, BLOCK_K2)
            # written by other programs: the barrier's acquire makes their stores visible
            a = tl.load(act_ptr + k, mask=k < INTER, other=0.0)
            acc += _weight_tile(wd_ptr, n, k, mask, stride_d) * a.to(tl.float32)[None, :]
            if last:
                tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), n < H)
                acc = tl.zeros([BLOCK_N, BLOCK_K2], dtype=tl.float32)


@triton.jit
def _task_count(n_tasks, pid, num_programs):
    """Tasks pid, pid + P, ... below n_tasks: how many program pid has."""
    return tl.maximum(n_tasks - pid + num_programs - 1, 0) // num_programs


@triton.jit
def _task_tile(t, pid, num_programs, kt_n, R_LIM, K_LIM, BR: tl.constexpr, BK: tl.constexpr):
    """Step t of a program's (task, K tile) sequence: the task's BR rows, the tile's BK columns,
    their in-bounds mask and whether it is the task's last K tile."""
    task = pid + (t // kt_n) * num_programs
    kt = t % kt_n
    r = task * BR + tl.arange(0, BR)
    k = kt * BK + tl.arange(0, BK)
    return r, k, (r < R_LIM)[:, None] & (k < K_LIM)[None, :], kt == kt_n - 1


@triton.jit
def _weight_tile(w_ptr, r, k, mask, stride):
    """Rows r x columns k of a row-major weight, as fp32 (masked lanes 0)."""
    w = tl.load(w_ptr + r.to(tl.int64)[:, None] * stride + k[None, :], mask=mask, other=0.0)
    return w.to(tl.float32)


@dataclass(frozen=True)
class FusedMlpConfig:
    block_i: int = 8  # phase 1: [8 gate + 8 up rows, 512] tiles: 16 KiB of bf16 a stage
    block_k: int = 512
    block_n: int = 8  # phase 2: [8, 1024] tiles
    block_k2: int = 1024
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_i", "block_k", "block_n", "block_k2"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"FusedMlpConfig.{name}={v}: a power of two")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"FusedMlpConfig: positive warps and stages, got {self}")


def fused_mlp_ref(
    hidden: torch.Tensor,  # [1, H]
    residual: torch.Tensor,  # [1, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    w_gate_up: torch.Tensor,  # [2I, H], gate rows first
    w_down: torch.Tensor,  # [H, I]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) of the normed hidden + residual, hidden + residual) as the unfused
    kernels compute it: the model dtype after every step, fp32 sums."""
    from pagoda.kernels.fused_ops import fused_add_rms_norm_ref, silu_and_mul_ref

    x, new_residual = fused_add_rms_norm_ref(hidden, residual, norm_weight, eps)
    gate_up = (x.float() @ w_gate_up.float().t()).to(x.dtype)
    act = silu_and_mul_ref(gate_up)
    return (act.float() @ w_down.float().t()).to(x.dtype), new_residual


def fused_mlp_supported(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[bool, str]:
    """Whether `fused_mlp_decode` takes these operands, and if not why."""
    if hidden.dim() != 2 or hidden.shape[0] != 1:
        return False, f"one row only, got {list(hidden.shape)}"
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return False, f"bf16 / fp16 only, got {hidden.dtype}"
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        return False, "dense weights in the activations' dtype only"
    h = hidden.shape[1]
    if h > MAX_HIDDEN:
        return False, f"hidden size {h} > {MAX_HIDDEN}"
    if w_gate_up.dim() != 2 or w_gate_up.shape[1] != h or w_gate_up.shape[0] % 2:
        return False, f"gate_up must be [2I, {h}], got {list(w_gate_up.shape)}"
    inter = w_gate_up.shape[0] // 2
    if w_down.dim() != 2 or tuple(w_down.shape) != (h, inter):
        return False, f"down must be [{h}, {inter}], got {list(w_down.shape)}"
    if w_gate_up.stride(1) != 1 or w_down.stride(1) != 1:
        return False, "weights need unit stride along K"
    return True, ""


def _check_norm_inputs(
    hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
) -> None:
    """The residual as hidden's shape and dtype, the norm weight one contiguous [H] of it: the
    kernels index both by hidden's H, so a mismatch would read past them."""
    if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
        raise ValueError(f"residual must be {list(hidden.shape)} {hidden.dtype}")
    h = hidden.shape[1]
    if norm_weight.shape != (h,) or norm_weight.dtype != hidden.dtype or norm_weight.stride(0) != 1:
        raise ValueError(
            f"norm weight must be a contiguous [{h}] {hidden.dtype} tensor, got "
            f"{list(norm_weight.shape)} {norm_weight.dtype}"
        )


def fused_mlp_decode(
    hidden: torch.Tensor,  # [1, H] (o_proj's output)
    residual: torch.Tensor,  # [1, H]
    norm_weight: torch.Tensor,  # [H] post_attention_layernorm
    eps: float,
    w_gate_up: torch.Tensor,  # [2I, H]
    w_down: torch.Tensor,  # [H, I]
    act: torch.Tensor,  # scratch, >= I elements of the model dtype
    barrier: torch.Tensor,  # int32 [2], zeroed once (`SplitKWorkspace.barrier`)
    config: FusedMlpConfig | None = None,
    two_launches: bool = False,  # phase 1, then phase 2: no barrier (the interpreter's tests)
) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output [1, H], new residual [1, H])
    ok, why = fused_mlp_supported(hidden, w_gate_up, w_down)
    if not ok:
        raise ValueError(f"fused_mlp_decode: {why}")
    _check_norm_inputs(hidden, residual, norm_weight)
    h = hidden.shape[1]
    inter = w_gate_up.shape[0] // 2
    if act.numel() < inter or act.dtype != hidden.dtype or not act.is_contiguous():
        raise ValueError(f"act scratch: >= {inter} contiguous {hidden.dtype} elements")
    if barrier.dtype != torch.int32 or barrier.numel() < 2:
        raise ValueError("barrier: int32 [2]")
    cfg = config or FusedMlpConfig()
    hidden = hidden.contiguous()
    residual = residual.contiguous()
    out = torch.empty_like(hidden)
    new_residual = torch.empty_like(hidden)
    tasks = max(triton.cdiv(inter, cfg.block_i), triton.cdiv(h, cfg.block_n))
    gpu = hidden.is_cuda and not envs.triton_interpret()
    if gpu:
        programs = min(tasks, platform.num_sms(hidden.device))  # one an SM: all resident
    else:  # the interpreter runs programs in turn: a barrier can only hold one
        programs = min(tasks, 3) if two_launches else 1
    launch = pdl_launch_args(hidden)
    if gpu and not two_launches:
        launch["launch_cooperative_grid"] = True  # all resident, or the launch fails
    for phase in (1, 2) if two_launches else (3,):
        _fused_mlp_kernel[(programs,)](
            hidden, residual, norm_weight, w_gate_up, w_down, out, new_residual, act, barrier,
            h, inter, eps, w_gate_up.stride(0), w_down.stride(0),
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_I=cfg.block_i,
            BLOCK_K=cfg.block_k,
            BLOCK_N=cfg.block_n,
            BLOCK_K2=cfg.block_k2,
            PHASES=phase,
            DROP=_drop_bits(hidden.dtype),
            NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **launch,
        )  # fmt: skip
    return out, new_residual


# ------------------------------------------- W4A16 (the tensor-core layout of triton_w4a16_mma)


@triton.jit
def _w4_task_load(q, pid, num_programs, steps, n_tasks, groups_i, kb_total, n_groups_s, which,
                  g, kt, j, w_ptr, sp_ptr, zp_ptr, G: tl.constexpr, KT: tl.constexpr,
                  GROUP_TILES: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """Words, scale pairs and (HAS_ZP) zero pairs [2 G KT, 128] of position q of a program's
    (task, step) sequence: rows (which, g, kt) are gate (which 0) or up (1) column group
    task * G + g, K tile step * KT + kt. The task is clamped to a real one (q past the end
    re-reads the last), so no load needs a mask."""
    task = tl.minimum(pid + (q // steps) * num_programs, n_tasks - 1)
    ng = which * groups_i + task * G + g  # [R, 1]
    kb = (q % steps) * KT + kt  # [R, 1]
    return load_tiles(ng, kb, kb_total, n_groups_s, j, w_ptr, sp_ptr, zp_ptr, GROUP_TILES,
                      HAS_ZP)  # fmt: skip


@triton.jit
def _w4_task_mma(acc, words, sp, zp, q, steps, kt, x_lane, KT: tl.constexpr,
                 INTERPRET: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """acc += the tiles of position q times the normalised row (bf16 pairs from the program's
    slot, in the MMA's lane order)."""
    kb = (q % steps) * KT + kt  # [R, 1]
    x1 = tl.load(x_lane + kb * 32)
    x2 = tl.load(x_lane + kb * 32 + 4)
    return _tile_mma(acc, words, x1, x2, sp, zp, INTERPRET, HAS_ZP)


@triton.jit
def _w4_task_store(acc, q, pid, num_programs, steps, act_ptr, M, INTER, DROP: tl.constexpr,
                   G: tl.constexpr, KT: tl.constexpr):  # fmt: skip
    """The end of a task: gate and up sums of its G column groups (the MMA's lane order: element
    v of lane (gid, c) is column gid + 8 (v // 2) of activation row 2 c + v % 2; rows past M are
    not stored), each rounded as the GEMV stores them, then silu(gate) * up into the scratch
    rows [M, I]."""
    task = pid + (q // steps) * num_programs
    part = tl.sum(tl.reshape(acc, [2, G, KT, 128]), axis=2)  # [2, G, 128]
    sel = tl.arange(0, 2)[:, None, None]
    gate = _round(tl.sum(tl.where(sel == 0, part, 0.0), axis=0), DROP)  # [G, 128]
    up = _round(tl.sum(tl.where(sel == 1, part, 0.0), axis=0), DROP)
    act = _round(_round(gate / (1.0 + tl.exp(-gate)), DROP) * up, DROP)
    jj = tl.arange(0, 128)[None, :]
    vv = jj % 4
    col = (task * G + tl.arange(0, G)[:, None]) * 16 + jj // 16 + 8 * (vv // 2)
    m = 2 * ((jj // 4) % 4) + vv % 2
    ok = tl.broadcast_to(m < M, [G, 128])
    tl.store(act_ptr + m * INTER + col, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_gate_up_silu_w4_kernel(
    h_ptr, r_ptr, nw_ptr, xs_ptr, xsi_ptr, w_ptr, sp_ptr, zp_ptr, act_ptr, r_out_ptr,
    M, H, INTER, eps, n_groups_s,
    BLOCK_H: tl.constexpr,  # next power of 2 of H
    GROUP_TILES: tl.constexpr,  # K tiles per scale group (0: one scale per column)
    KT: tl.constexpr,  # K tiles a step (divides H / 64)
    G: tl.constexpr,  # gate (and up) column groups a task (divides I / 16)
    HAS_ZP: tl.constexpr,
    DROP: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Residual add + RMSNorm, then silu(x W_gate^T) * (x W_up^T) of M <= 8 rows for W4A16
    weights stored by `repack_mma` (gate column groups first, as `gate_up_proj` stacks them): a
    fixed set of programs, each writing the normalised rows into its own slot of `xs` (read
    back in the MMA's pair order, lane group g taking row min(g, M - 1) as the GEMV does; its
    own stores, after a CTA barrier), then walking its tasks (G gate column groups with their
    up groups, all of K) as one sequence of steps with two register sets ping-ponged as in
    `_w4_mma_gemv_kernel`."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    kb_total = H // 64
    steps = kb_total // KT
    groups_i = INTER // 16
    n_tasks = groups_i // G
    nq = _task_count(n_tasks, pid, num_programs) * steps
    R: tl.constexpr = 2 * G * KT
    rr = tl.arange(0, R)[:, None]
    which = rr // (G * KT)
    g = (rr // KT) % G
    kt = rr % KT
    j = tl.arange(0, 128)[None, :]
    last = tl.maximum(nq - 1, 0)
    # the first weights never depend on the previous kernel: loaded before the wait
    wa, spa, zpa = _w4_task_load(0, pid, num_programs, steps, n_tasks, groups_i, kb_total,
                                 n_groups_s, which, g, kt, j, w_ptr, sp_ptr, zp_ptr, G, KT,
                                 GROUP_TILES, HAS_ZP)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    wn = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    slot = xs_ptr + pid * M * H
    for row in range(M):
        hs = tl.load(h_ptr + row * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        rs = tl.load(r_ptr + row * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        s = _round(hs + rs, DROP)
        if pid == 0:
            tl.store(r_out_ptr + row * H + cols, s.to(r_out_ptr.dtype.element_ty), mask=col_ok)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        x = _round(wn * _round(s * rstd, DROP), DROP)
        tl.store(slot + row * H + cols, x.to(xs_ptr.dtype.element_ty), mask=col_ok)
    tl.debug_barrier()  # the slot is read back below by other threads of this program
    x_row = tl.minimum(j // 16, M - 1)  # lane group g feeds the MMA's column g: row g
    x_lane = xsi_ptr + (pid * M + x_row) * (H // 2) + 8 * ((j // 4) % 4) + j % 4  # + kb * 32

    acc = tl.zeros([R, 128], dtype=tl.float32)
    qa = 0
    for i in range(0, nq, 2):
        qb = tl.minimum(qa + 1, last)
        wb, spb, zpb = _w4_task_load(qb, pid, num_programs, steps, n_tasks, groups_i, kb_total,
                                     n_groups_s, which, g, kt, j, w_ptr, sp_ptr, zp_ptr, G, KT,
                                     GROUP_TILES, HAS_ZP)  # fmt: skip
        acc = _w4_task_mma(acc, wa, spa, zpa, qa, steps, kt, x_lane, KT, INTERPRET, HAS_ZP)
        if qa % steps == steps - 1:
            _w4_task_store(acc, qa, pid, num_programs, steps, act_ptr, M, INTER, DROP, G, KT)
            acc = tl.zeros([R, 128], dtype=tl.float32)
        qa2 = tl.minimum(qa + 2, last)
        wa, spa, zpa = _w4_task_load(qa2, pid, num_programs, steps, n_tasks, groups_i,
                                     kb_total, n_groups_s, which, g, kt, j, w_ptr, sp_ptr,
                                     zp_ptr, G, KT, GROUP_TILES, HAS_ZP)  # fmt: skip
        if i + 1 < nq:
            acc = _w4_task_mma(acc, wb, spb, zpb, qb, steps, kt, x_lane, KT, INTERPRET, HAS_ZP)
            if qb % steps == steps - 1:
                _w4_task_store(acc, qb, pid, num_programs, steps, act_ptr, M, INTER, DROP, G,
                               KT)  # fmt: skip
                acc = tl.zeros([R, 128], dtype=tl.float32)
        qa = qa2
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@dataclass(frozen=True)
class FusedW4Config:
    k_tiles: int = 4  # K tiles of 64 a step (the largest power of two <= it dividing H / 64)
    groups: int = 1  # gate column groups of 16 a task (likewise, dividing I / 16)
    num_warps: int = 4
    programs_per_sm: int = 4


def _divisor_at_most(n: int, target: int) -> int:
    """The largest power of two <= target dividing n (tile rows are powers of two)."""
    d = 1
    while d * 2 <= target and n % (d * 2) == 0:
        d *= 2
    return d


MAX_W4_ROWS = 8  # rows a call: one block of the MMA's 8 activation columns


def norm_gate_up_silu_w4a16(
    hidden: torch.Tensor,  # [M, H] bf16, M <= 8
    residual: torch.Tensor,  # [M, H] bf16
    norm_weight: torch.Tensor,  # [H] bf16
    eps: float,
    words: torch.Tensor,  # gate_up's `repack_mma` words ([2I, H] weights, gate rows first)
    scale_pairs: torch.Tensor,  # `repack_mma_scales` [2I / 16, groups, 8] int32
    group_size: int,
    zero_pairs: torch.Tensor | None,  # `repack_mma_zeros`, or None (symmetric)
    act: torch.Tensor,  # the output rows: >= M x I bf16 elements (contiguous)
    xs: torch.Tensor,  # scratch: >= programs x M x H bf16 elements (the normalised rows' slots)
    config: FusedW4Config | None = None,
) -> torch.Tensor:  # the new residual [M, H]; act[:M * I] = silu(gate) * up of norm(h + r)
    """The MLP's first half for up to 8 rows and W4A16 gate_up weights in one launch; the caller
    runs down_proj on act[:M * I] viewed [M, I] (its own kernel). Same result as
    `fused_add_rms_norm`, the tensor-core GEMV of gate_up and `silu_and_mul`, up to the order
    of the fp32 sums."""
    if hidden.dim() != 2 or not 1 <= hidden.shape[0] <= MAX_W4_ROWS:
        raise ValueError(f"hidden must be 1-{MAX_W4_ROWS} rows, got {list(hidden.shape)}")
    if hidden.dtype != torch.bfloat16:
        raise ValueError(f"hidden must be bf16, got {hidden.dtype}")
    m, h = hidden.shape
    n = 2 * (words.numel() * 8 // (2 * h))
    inter = n // 2
    _check_norm_inputs(hidden, residual, norm_weight)
    if words.numel() * 8 != n * h or not mma_supported(n, h, group_size, 4, zero_pairs is not None):
        raise ValueError(f"gate_up words of {words.numel()} int32 do not hold a [2I, {h}] layout")
    cfg = config or FusedW4Config()
    kt = _divisor_at_most(h // 64, cfg.k_tiles)
    g = _divisor_at_most(inter // 16, cfg.groups)
    programs = norm_gate_up_silu_w4a16_programs(hidden, inter, cfg)
    if act.numel() < m * inter or act.dtype != hidden.dtype or not act.is_contiguous():
        raise ValueError(f"act: >= {m} x {inter} contiguous bf16 elements")
    if xs.numel() < programs * m * h or xs.dtype != hidden.dtype or not xs.is_contiguous():
        raise ValueError(f"xs scratch: >= {programs} x {m} x {h} contiguous bf16 elements")
    hidden, residual = hidden.contiguous(), residual.contiguous()
    new_residual = torch.empty_like(hidden)
    sp = scale_pairs.view(torch.int8)
    zp = zero_pairs.view(torch.int8) if zero_pairs is not None else sp
    per_channel = group_size <= 0 or group_size >= h
    _norm_gate_up_silu_w4_kernel[(programs,)](
        hidden, residual, norm_weight, xs, xs.view(torch.int32), words, sp, zp, act,
        new_residual, m, h, inter, eps, scale_pairs.shape[1],
        BLOCK_H=triton.next_power_of_2(h),
        GROUP_TILES=0 if per_channel else group_size // 64,
        KT=kt,
        G=g,
        HAS_ZP=zero_pairs is not None,
        DROP=_drop_bits(hidden.dtype),
        INTERPRET=_INTERPRET,
        num_warps=min(cfg.num_warps, 2 * g * kt),
        **pdl_launch_args(hidden),
    )  # fmt: skip
    return new_residual


def norm_gate_up_silu_w4a16_programs(
    hidden: torch.Tensor, inter: int, config: FusedW4Config | None = None
) -> int:
    """How many programs (slots of the `xs` scratch) `norm_gate_up_silu_w4a16` launches: one a
    task up to `programs_per_sm` an SM (3 under the interpreter)."""
    cfg = config or FusedW4Config()
    tasks = max(1, inter // 16 // _divisor_at_most(inter // 16, cfg.groups))
    gpu = hidden.is_cuda and not envs.triton_interpret()
    return min(tasks, platform.num_sms(hidden.device) * cfg.programs_per_sm if gpu else 3)

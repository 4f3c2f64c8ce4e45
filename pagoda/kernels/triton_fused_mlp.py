"""The decoder's MLP half at batch 1 in one launch: residual add + RMSNorm, gate_up, SiLU-and-mul,
down_proj (dense bf16 / fp16 weights).

Unfused, a batch-1 decode step runs four kernels for it (the fused add-RMSNorm, the gate_up GEMV,
SiLU-and-mul, the down GEMV), each paying its launch and ramp-up. An earlier attempt put the norm
into every GEMV program's prologue and measured slower: thousands of programs each recomputed the
norm. Here a fixed set of P programs (about one an SM) does everything:

1. every program adds the residual and takes the RMS statistics of the row (H values from the
   L2); program 0 stores the new residual;
2. phase 1: the intermediate features go to the programs in tasks of BLOCK_I: a task reads
   BLOCK_I gate rows and the BLOCK_I matching up rows, the normalised input recomputed per K
   tile from the (cached) hidden, residual and norm weight; it stores silu(gate) * up into a
   scratch row of I values;
3. a grid barrier (every program must be resident: the launch is cooperative);
4. phase 2: down_proj's output rows go to the programs in tasks of BLOCK_N, each reading the
   whole scratch row (through the L2: it was written by other SMs).

Each program's tasks run as one flat loop over (task, K tile), so the software pipeline streams
the weights across task boundaries without draining. Rounding follows the unfused kernels step
for step (`triton_fused_ops`: the sum and the normalised row in the model dtype, the gate / up
sums, silu and the product each rounded), so the result equals them up to the order of the fp32
sums. `two_launches` runs phase 1, then phase 2 as a second launch (no barrier): the CPU
interpreter runs programs one after the other, so it checks the barrier with one program only.

Torch reference: `fused_mlp_ref`. Used by `DecoderLayer` when `fused_mlp_decode` is on (off by
default until measured on a GPU).
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
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if PHASES != 2:
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < H
        hs = tl.load(h_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        rs = tl.load(r_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        s = _round(hs + rs, DROP)  # the residual add in the model dtype, as HF does
        if pid == 0:
            tl.store(r_out_ptr + cols, s.to(r_out_ptr.dtype.element_ty), mask=col_ok)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)

        n_tasks = tl.cdiv(INTER, BLOCK_I)
        kt_n = tl.cdiv(H, BLOCK_K)
        mine = tl.maximum(n_tasks - pid + num_programs - 1, 0) // num_programs
        rows = tl.arange(0, BLOCK_I)
        offs_k = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        for t in tl.range(0, mine * kt_n, num_stages=NUM_STAGES):
            task = pid + (t // kt_n) * num_programs
            kt = t % kt_n
            k = kt * BLOCK_K + offs_k
            k_ok = k < H
            i = task * BLOCK_I + rows
            i_ok = i < INTER
            # the normalised input of this K tile: (h + r) * rstd, rounded, times the weight
            hk = tl.load(h_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            rk = tl.load(r_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            wk = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            xk = _round(wk * _round(_round(hk + rk, DROP) * rstd, DROP), DROP)
            mask = i_ok[:, None] & k_ok[None, :]
            g_rows = wgu_ptr + i.to(tl.int64)[:, None] * stride_gu
            u_rows = wgu_ptr + (i + INTER).to(tl.int64)[:, None] * stride_gu
            g = tl.load(g_rows + k[None, :], mask=mask, other=0.0)
            u = tl.load(u_rows + k[None, :], mask=mask, other=0.0)
            acc_g += g.to(tl.float32) * xk[None, :]
            acc_u += u.to(tl.float32) * xk[None, :]
            if kt == kt_n - 1:
                gate = _round(tl.sum(acc_g, axis=1), DROP)
                up = _round(tl.sum(acc_u, axis=1), DROP)
                act = _round(gate / (1.0 + tl.exp(-gate)), DROP)
                tl.store(act_ptr + i, _round(act * up, DROP).to(act_ptr.dtype.element_ty), i_ok)
                acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    if PHASES == 3:
        _grid_barrier(bar_ptr, num_programs)
    if USE_PDL:  # every program is resident and past its reads of the inputs
        tl.extra.cuda.gdc_launch_dependents()
    if PHASES != 1:
        n_tasks2 = tl.cdiv(H, BLOCK_N)
        kt_n2 = tl.cdiv(INTER, BLOCK_K2)
        mine2 = tl.maximum(n_tasks2 - pid + num_programs - 1, 0) // num_programs
        rows2 = tl.arange(0, BLOCK_N)
        offs_k2 = tl.arange(0, BLOCK_K2)
        acc = tl.zeros([BLOCK_N, BLOCK_K2], dtype=tl.float32)
        for t in tl.range(0, mine2 * kt_n2, num_stages=NUM_STAGES):
            task = pid + (t // kt_n2) * num_programs
            kt = t % kt_n2
            k = kt * BLOCK_K2 + offs_k2
            k_ok = k < INTER
            n = task * BLOCK_N + rows2
            n_ok = n < H
            w = tl.load(
                wd_ptr + n.to(tl.int64)[:, None] * stride_d + k[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            # written by other programs: the barrier's acquire makes their stores visible
            a = tl.load(act_ptr + k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
            if kt == kt_n2 - 1:
                tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), n_ok)
                acc = tl.zeros([BLOCK_N, BLOCK_K2], dtype=tl.float32)


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
    if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
        raise ValueError(f"residual must be {list(hidden.shape)} {hidden.dtype}")
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

"""Triton kernels for unmerged LoRA: `out[t] (+)= x[t] @ w[slot(t)]^T` for every token t.

One kernel serves both halves of a LoRA layer. Each token carries its adapter slot
(`token_slots [T]`, -1 = none); the grid is (output tile x K split, token tile, slot), and a
program works on the rows of its tile whose slot is its own (it exits at once when there are
none). A weight is thus read once per token tile and adapter in use, however the tokens are
cut into requests, and the grid depends on shapes alone: launches are CUDA-graph safe.

- shrink, `x [T, in] @ A[slot]^T -> [T, S*R]`: a long K (2048 .. 11008) for a few dozen
  outputs, so K is split over programs. Each adds its fp32 partial into a zeroed workspace row
  (`atomic_add`); the last of a tile's programs to arrive (counted by an atomic counter) reads
  the sums back, writes the output rows, and leaves the workspace and counter at zero again.
  No memset and no second pass: one launch, nothing read on the host.
- expand, `y [T, out] += rank [T, S*R] @ B[slot]^T`: K = S*R <= 128 in one step, wide output
  tiles, `y` read before the weights so both loads are in flight together.

Torch references: `pagoda.kernels.lora.ops.lora_sgmv_ref` / `lora_shrink_expand_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagoda.kernels.lora.workspace import LoRAWorkspace


@triton.jit
def _mma(acc, a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in float32 (a converted to b's type; both to float32 when interpreted)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = a.to(b.dtype)
    if IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    else:
        return acc + tl.dot(a, b)


@triton.jit(do_not_specialize=["T"])  # one compile for every token count
def _lora_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    slots_ptr,
    ws_ptr,  # [>= T, >= N] float32, zero outside a launch (split-K only)
    cnt_ptr,  # int32 counters, zero outside a launch (split-K only)
    T,
    N,
    K,
    k_chunk,  # K per split, a multiple of BLOCK_K
    num_splits,
    stride_xt,
    stride_xk,
    stride_wl,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_on,
    stride_ws,
    ADD: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,  # SPLIT with one K step per split
    IEEE: tl.constexpr,  # float32 inputs: full-precision dot, not TF32
    UPCAST: tl.constexpr,  # interpreter only: its numpy dot has no bfloat16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) % n_tiles
    pid_k = tl.program_id(0) // n_tiles
    pid_m = tl.program_id(1)
    slot = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    w_base = w_ptr + slot.to(tl.int64) * stride_wl
    k_lo = pid_k * k_chunk
    if PREFETCH:
        # one K step per split: its loads go out with the slot load, one round trip for all
        # (a program of an adapter nobody uses wastes them; few slots, so little)
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a0 = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
            mask=(offs_m < T)[:, None] & mask_k[None, :],
            other=0.0,
        )
        b0 = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
    tok_slot = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    sel = tok_slot == slot  # this program's rows: the tile's tokens of adapter `slot`
    if tl.max(sel.to(tl.int32), axis=0) == 0:
        return  # also every program of an adapter nobody uses, and slot -1 / padding rows
    mask = sel[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ADD and not SPLIT:  # issued before the weight loads: one round trip for both
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    if PREFETCH:
        acc = _mma(acc, tl.where(sel[:, None], a0, tl.zeros_like(a0)), b0, IEEE, UPCAST)
    else:
        k_hi = tl.minimum(k_lo + k_chunk, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            a = tl.load(
                x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                mask=sel[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            b = tl.load(
                w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            acc = _mma(acc, a, b, IEEE, UPCAST)

    if SPLIT:
        ws_ptrs = ws_ptr + rows[:, None] * stride_ws + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
        # Every thread's partial sums precede the counter increment (CTA barrier, then the
        # increment's release at GPU scope); its acquire orders the read-back after all of them.
        tl.debug_barrier()
        cnt = cnt_ptr + (pid_m * tl.num_programs(2) + slot) * n_tiles + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the last split of this tile: finish it
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(acc), mask=mask, sem="acq_rel")
            tl.store(ws_ptrs, tl.zeros_like(acc), mask=mask)  # zero again for the next launch
            tl.atomic_xchg(cnt, 0, sem="relaxed")
            if ADD:
                total = tl.where(mask, total, 0.0)  # (masked-off lanes of an atomic: undefined)
                total += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# TRITON_INTERPRET=1 at import time turns the kernel into an interpreted (numpy) function.
_INTERPRETED = not isinstance(_lora_kernel, triton.runtime.JITFunction)
INTERPRETED = _INTERPRETED

# Split-K aims at about this many programs per adapter in use (an H100/H200 has 132 SMs).
_TARGET_PROGRAMS = 128
# Up to this many slots, a one-step split loads its tiles before knowing if they are needed.
_PREFETCH_MAX_SLOTS = 8


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # 1: no split
    num_warps: int


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def choose_config(
    num_tokens: int, n: int, k: int, workspace_ok: bool = True, split_k: int | None = None
) -> LoRAKernelConfig:
    """Tiles for `out [T, n] (+)= x [T, k] @ w^T`: shrink-like (small n, long k) or expand-like.

    tl.dot needs tiles of at least 16: a decode tile of one token wastes the rest of the M
    tile, which costs nothing next to the weight loads these launches wait on.
    """
    block_m = _block(num_tokens, 16, 64)
    m_tiles = triton.cdiv(num_tokens, block_m)
    if n <= 256 and k > n:  # shrink: a few outputs over a long reduction
        block_n = _block(n, 16, 128)
        block_k = _block(k, 16, 256 if block_n <= 32 else 128)
    else:  # expand: wide outputs over the rank
        block_n = _block(n, 16, 128 if n >= 8192 else 64)
        block_k = _block(k, 16, 128 if block_n <= 64 else 64)
    n_tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = 1
        if workspace_ok and k_blocks > 1:
            split_k = min(k_blocks, triton.cdiv(_TARGET_PROGRAMS, m_tiles * n_tiles))
    split_k = max(1, min(split_k, k_blocks))
    # every split non-empty
    split_k = triton.cdiv(k_blocks, triton.cdiv(k_blocks, split_k))
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    return LoRAKernelConfig(block_m, block_n, block_k, split_k, num_warps)


def lora_gemm_triton(
    x: torch.Tensor,  # [T, K]
    w: torch.Tensor,  # [L, N, K]
    token_slots: torch.Tensor,  # [>= T] int32, adapter slot per token, -1 = none
    out: torch.Tensor,  # [T, N]
    add: bool,
    workspace: LoRAWorkspace | None = None,
    config: LoRAKernelConfig | None = None,
) -> torch.Tensor:
    """`out[t] (+)= x[t] @ w[token_slots[t]]^T`; rows with slot -1 are not written.

    With a workspace (shared by all layers; every launch leaves it zeroed), a long K is split
    over programs when the token count fits it. `config` overrides `choose_config`.
    """
    num_slots, n, k = w.shape
    num_tokens = x.shape[0]
    assert x.shape[1] == k and out.shape == (num_tokens, n), (x.shape, w.shape, out.shape)
    assert token_slots.dtype == torch.int32 and token_slots.shape[0] >= num_tokens
    if num_tokens == 0:
        return out
    fits = _workspace_fits(workspace, num_tokens, n)

    def counters_ok(cfg: LoRAKernelConfig) -> bool:  # one per (token tile, slot, output tile)
        tiles = triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        return tiles * num_slots <= workspace.counters.numel()

    if config is None:
        config = choose_config(num_tokens, n, k, fits)
        if config.split_k > 1 and not counters_ok(config):
            config = replace(config, split_k=1)
    split = config.split_k > 1
    if split:
        assert fits and counters_ok(config), "split-K needs a workspace of at least [T, N]"
        ws, counters = workspace.acc, workspace.counters
    else:
        ws, counters = out, token_slots  # not read
    k_blocks = triton.cdiv(k, config.block_k)
    k_chunk = triton.cdiv(k_blocks, config.split_k) * config.block_k
    grid = (
        config.split_k * triton.cdiv(n, config.block_n),
        triton.cdiv(num_tokens, config.block_m),
        num_slots,
    )
    _lora_kernel[grid](
        x,
        w,
        out,
        token_slots,
        ws,
        counters,
        num_tokens,
        n,
        k,
        k_chunk,
        config.split_k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        ws.stride(0) if split else 0,
        ADD=add,
        SPLIT=split,
        PREFETCH=split and k_chunk == config.block_k and num_slots <= _PREFETCH_MAX_SLOTS,
        IEEE=w.dtype == torch.float32 or _INTERPRETED,
        UPCAST=_INTERPRETED and w.dtype == torch.bfloat16,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )
    return out


def _workspace_fits(workspace: LoRAWorkspace | None, num_tokens: int, n: int) -> bool:
    if workspace is None:
        return False
    rows, cols = workspace.acc.shape
    return num_tokens <= rows and n <= cols


def lora_shrink_expand_triton(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S*R, in]
    lora_b: torch.Tensor,  # [L, out, S*R]
    token_slots: torch.Tensor,  # [>= T] int32
    y: torch.Tensor,  # [T, out], updated in place
    workspace: LoRAWorkspace | None,
    shrink_config: LoRAKernelConfig | None = None,
    expand_config: LoRAKernelConfig | None = None,
) -> torch.Tensor:
    """A whole LoRA layer in two launches: `y[t] += B[s] @ (A[s] @ x[t])`, s = slot of t.

    The rank-space rows are rounded to x's dtype between the two, as the reference does.
    """
    rank = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    lora_gemm_triton(x, lora_a, token_slots, rank, False, workspace, shrink_config)
    lora_gemm_triton(rank, lora_b, token_slots, y, True, None, expand_config)
    return y


def segments_to_token_slots(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_segs: int, num_tokens: int
) -> torch.Tensor:
    """Per-token slots of a segment table, on the device and without a host sync; rows outside
    the segments get -1."""
    device = seg_slots.device
    starts = seg_starts[: num_segs + 1].long()
    rows = torch.arange(num_tokens, device=device)
    seg = torch.searchsorted(starts[1:], rows, right=True).clamp_(max=max(num_segs - 1, 0))
    inside = (rows >= starts[0]) & (rows < starts[-1])
    minus_one = torch.full_like(rows, -1, dtype=torch.int32)
    return torch.where(inside, seg_slots[seg].to(torch.int32), minus_one)


def lora_sgmv_triton(
    x: torch.Tensor,  # [T, K]
    w: torch.Tensor,  # [L, N, K]
    seg_starts: torch.Tensor,  # [>= S+1] int32
    seg_slots: torch.Tensor,  # [>= S] int32
    num_segs: int,
    max_seg_len: int,
    out: torch.Tensor,  # [T, N]
    add: bool,
    workspace: LoRAWorkspace | None = None,
) -> torch.Tensor:
    """See `pagoda.kernels.lora.ops.lora_sgmv`: the segment table expanded to token slots (a few
    small device ops), then `lora_gemm_triton`. `max_seg_len` is no longer needed."""
    del max_seg_len
    if num_segs == 0 or x.shape[0] == 0:
        return out
    token_slots = segments_to_token_slots(seg_starts, seg_slots, num_segs, x.shape[0])
    return lora_gemm_triton(x, w, token_slots, out, add, workspace)

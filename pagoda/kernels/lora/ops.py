"""Batched low-rank products for serving many LoRA adapters in one batch (the "sgmv" pattern).

The flat batch is cut into segments (a request's tokens, or single tokens in a CUDA-graph
decode); segment i uses adapter slot `seg_slots[i]` of stacked weights `w [L, N, K]`, or none
when the slot is -1. `lora_sgmv` computes `out[t] (+)= x[t] @ w[slot(t)]^T`: the Triton kernel
of `triton_lora.py` on CUDA, the torch reference `lora_sgmv_ref` elsewhere.

`lora_shrink_expand` is a whole LoRA layer (`y[t] += B[s] A[s] x[t]`) from per-token slots, in
two kernel launches; its split-K shrink uses a `LoRAWorkspace` that every layer shares.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pagoda import envs
from pagoda.kernels.lora.workspace import LoRAWorkspace
from pagoda.platform import triton_available


@functools.cache
def _triton_lora() -> ModuleType | None:
    """The Triton module, or None without Triton (imported on first use: TRITON_INTERPRET is
    read when the kernel module is imported)."""
    if not triton_available():
        return None
    from pagoda.kernels.lora import triton_lora

    return triton_lora


def lora_sgmv_ref(
    x: torch.Tensor,  # [T, K]
    w: torch.Tensor,  # [L, N, K]
    seg_starts: torch.Tensor,  # [>= S+1] int32, token offsets of the segments
    seg_slots: torch.Tensor,  # [>= S] int32, adapter slot per segment, -1 = none
    num_segs: int,
    out: torch.Tensor,  # [T, N]
    add: bool,
) -> torch.Tensor:
    """Reference: one matmul per adapter slot over the tokens that use it.

    Rows of segments without an adapter are left as they are when `add`, zeroed otherwise.
    """
    starts = seg_starts[: num_segs + 1].long()
    token_slots = torch.repeat_interleave(seg_slots[:num_segs].long(), starts[1:] - starts[:-1])
    if not add:
        out.zero_()
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().squeeze(1)
        # float32 accumulation, as the kernel does
        prod = x.index_select(0, idx).float() @ w[slot].float().T  # [n, N]
        if add:
            prod += out.index_select(0, idx).float()
        out.index_copy_(0, idx, prod.to(out.dtype))
    return out


def lora_grouped_ref(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S*R, in]
    lora_b: torch.Tensor,  # [L, out, S*R]
    groups: list[tuple[int, slice | torch.Tensor]],  # (slot, token rows) per adapter in use
    y: torch.Tensor,  # [T, out], updated in place
) -> torch.Tensor:
    """Shrink and expand of a whole LoRA layer, one matmul pair per adapter (CPU path).

    The row groups are computed once per step, so no layer re-derives them from the slots.
    """
    for slot, rows in groups:
        if isinstance(rows, slice):
            y[rows] += (x[rows] @ lora_a[slot].T) @ lora_b[slot].T
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)
    return y


def lora_sgmv(
    x: torch.Tensor,
    w: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    num_segs: int,
    max_seg_len: int,
    out: torch.Tensor,
    add: bool,
) -> torch.Tensor:
    """`out[t] (+)= x[t] @ w[slot]^T` per segment; Triton on CUDA, the reference elsewhere.

    With `add=False` the rows of segments without an adapter are undefined on CUDA (callers
    never read them: the expand step skips the same segments).
    """
    triton_lora = _triton_lora() if x.is_cuda else None
    if triton_lora is None:
        return lora_sgmv_ref(x, w, seg_starts, seg_slots, num_segs, out, add)
    return triton_lora.lora_sgmv_triton(
        x, w, seg_starts, seg_slots, num_segs, max_seg_len, out, add
    )


def lora_shrink_expand_ref(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S*R, in]
    lora_b: torch.Tensor,  # [L, out, S*R]
    token_slots: torch.Tensor,  # [>= T] int32, -1 = none
    y: torch.Tensor,  # [T, out], updated in place
) -> torch.Tensor:
    """Reference of `lora_shrink_expand`: `lora_sgmv_ref` twice, one segment per token, the
    rank-space rows rounded to x's dtype in between."""
    num_tokens = x.shape[0]
    starts = torch.arange(num_tokens + 1, dtype=torch.int32, device=token_slots.device)
    slots = token_slots[:num_tokens]
    rank = torch.empty(num_tokens, lora_a.shape[1], dtype=x.dtype, device=x.device)
    lora_sgmv_ref(x, lora_a, starts, slots, num_tokens, rank, add=False)
    return lora_sgmv_ref(rank, lora_b, starts, slots, num_tokens, y, add=True)


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    workspace: LoRAWorkspace | None = None,
) -> torch.Tensor:
    """`y[t] += B[s] @ A[s] @ x[t]` with s = `token_slots[t]` (rows with -1 untouched).

    The Triton kernels on CUDA (and on the CPU when Triton runs interpreted, as in the tests),
    the reference otherwise. Without a workspace the shrink is not split over K.
    """
    # On the CPU the module is imported only when Triton runs interpreted (the tests).
    triton_lora = _triton_lora() if x.is_cuda or envs.triton_interpret() else None
    if triton_lora is None or not (x.is_cuda or triton_lora.INTERPRETED):
        return lora_shrink_expand_ref(x, lora_a, lora_b, token_slots, y)
    return triton_lora.lora_shrink_expand_triton(x, lora_a, lora_b, token_slots, y, workspace)

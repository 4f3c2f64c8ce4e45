"""Scratch of the batched LoRA kernels' split-K shrink (`LoRAWorkspace`), shared by every
layer of a stream; allocated once, outside CUDA-graph capture."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAWorkspace:
    """Scratch of the split-K shrink: zero before and after every launch (each launch returns
    what it used to zero), so one instance serves every layer of a stream, graphs included."""

    acc: torch.Tensor  # [max_rows, max_cols] float32: partial sums of rank-space rows
    counters: torch.Tensor  # [n] int32: arrivals per (token tile, slot, output tile)


def lora_workspace(
    device: torch.device | str,
    max_rows: int = 1024,
    max_cols: int = 512,
    num_counters: int = 1 << 14,
) -> LoRAWorkspace:
    """Allocate (zeroed) a workspace: split-K serves layer inputs of up to `max_rows` tokens
    and rank spaces (S*R) of up to `max_cols`. Allocate it outside CUDA-graph capture."""
    return LoRAWorkspace(
        torch.zeros(max_rows, max_cols, dtype=torch.float32, device=device),
        torch.zeros(num_counters, dtype=torch.int32, device=device),
    )

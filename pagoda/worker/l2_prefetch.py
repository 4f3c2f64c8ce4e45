"""Weights streamed into the L2 while decode attention runs (sm_90+, small decode batches).

In a small-batch decode step the DRAM idles while the latency-bound attention runs (RoPE,
cache write, a few hundred keys, the split-KV reduce: ~8 µs a layer on an H200 at batch 1, time
in which the DRAM could stream ~30 MB). The projections after it (o_proj, gate_up, down, the
next layer's qkv) then read their weights at the DRAM's pace. Here each layer's attention gets a
`PrefetchPlan`: the byte ranges of those weights in the order they are read, cut at a budget
below the L2's size, which the fused decode attention kernel hands to the copy engine
(`cp.async.bulk.prefetch.L2`, `kernels/triton_l2_prefetch.py`) before it waits for its inputs.
Results never change; only where the next kernels' loads hit.

The runner binds the plans once at load (weights never move); a step uses its layer's plan when
it runs the fused decode attention with at most `max_tokens` sequences. `l2_prefetch` in
`PAGODA_DISABLED_KERNELS` turns it off for A/B runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagoda import envs, platform

ALIGN = 16  # the bulk prefetch's address and size granularity
L2_FRACTION = 0.6  # of the L2 a layer's plan may fill (the rest: KV, activations, partials)
MAX_TOKENS = 16  # decode batches up to this many sequences prefetch


@dataclass(frozen=True, eq=False)
class PrefetchPlan:
    """One layer's ranges: `ranges` [R, 2] int64 (address, bytes) on the weights' device, and
    the tensors they lie in (held, so the addresses stay valid as long as the plan)."""

    ranges: torch.Tensor
    nbytes: int
    max_tokens: int
    late: bool = False  # issued after the attention's own work instead of before its wait
    tensors: tuple[torch.Tensor, ...] = ()

    @property
    def num_ranges(self) -> int:
        return self.ranges.shape[0]

    def for_tokens(self, num_tokens: int) -> torch.Tensor | None:
        """The ranges a step of `num_tokens` decode sequences prefetches (None: none)."""
        return self.ranges if num_tokens <= self.max_tokens else None


def byte_ranges(tensors: Iterable[torch.Tensor], budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of `tensors` in order, 16-byte aligned inside each tensor, the total cut
    at `budget` bytes (the last range is a prefix); touching ranges are merged. Tensors that are
    not contiguous are skipped (their bytes are not one range)."""
    out: list[tuple[int, int]] = []
    left = budget // ALIGN * ALIGN
    for t in tensors:
        if left <= 0:
            break
        if t.numel() == 0 or not t.is_contiguous():
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        lo = -(-start // ALIGN) * ALIGN
        n = min((end // ALIGN * ALIGN) - lo, left)
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == lo:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((lo, n))
        left -= n
    return out


def linear_tensors(linear: nn.Module) -> list[torch.Tensor]:
    """What a linear layer's kernels read: its own parameters and buffers (one weight layout:
    `layers/wna16_kernels.py`), smallest first — scales and bias before the weight words, so a
    plan cut short still holds what every program of the GEMV needs."""
    own = [*linear.parameters(recurse=False), *linear.buffers(recurse=False)]
    return sorted((t.data for t in own), key=lambda t: t.numel() * t.element_size())


def default_budget(device: torch.device) -> int:
    """Bytes a layer's plan may prefetch on `device`: L2_FRACTION of its L2 on sm_90+ (the bulk
    prefetch) with Triton; 0 elsewhere or with `l2_prefetch` or `fused_decode_attn` disabled."""
    if device.type != "cuda" or platform.capability(device) < (9, 0):
        return 0
    if not platform.triton_available() or not envs.kernel_enabled("l2_prefetch"):
        return 0
    if not envs.kernel_enabled("fused_decode_attn"):  # the kernel that would issue it
        return 0
    # Measured on the H200 (BENCHMARKS.md, session 18): every budget, order and issue point
    # made Qwen2.5-3B's batch-1 decode graph slower (bf16 2.9, W4A16 6.0 µs a layer at the
    # default): no plan is bound by default until the code is deleted.
    return 0


def _after_attention(layers: Sequence[nn.Module], i: int, order: str) -> list[nn.Module]:
    """The linears a decode step reads after layer i's attention: in the order it reads them
    ("use"), or the smallest first ("size": the latency-bound small GEMVs gain the most per
    byte from the L2)."""
    layer = layers[i]
    linears = [layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    if i + 1 < len(layers):
        linears.append(layers[i + 1].self_attn.qkv_proj)
    if order == "size":
        linears.sort(key=lambda lin: sum(t.numel() * t.element_size() for t in linear_tensors(lin)))
    elif order != "use":
        raise ValueError(f"order must be 'use' or 'size', got {order!r}")
    return linears


def bind_l2_prefetch(
    layers: Sequence[nn.Module],
    budget: int,
    max_tokens: int = MAX_TOKENS,
    late: bool = False,
    order: str = "use",
) -> int:
    """Give every decoder layer's attention its plan (`attn.l2_prefetch`; None where `budget`
    is 0 or the layer is not a plain decoder layer). Returns the bytes one step prefetches."""
    total = 0
    for i, layer in enumerate(layers):
        attn = getattr(getattr(layer, "self_attn", None), "attn", None)
        if attn is None:
            continue
        plan = None
        if budget > 0 and hasattr(layer, "mlp"):
            linears = _after_attention(layers, i, order)
            tensors = [t for lin in linears for t in linear_tensors(lin)]
            device = tensors[0].device if tensors else None
            tensors = [t for t in tensors if t.device == device]  # (all of them in practice)
            ranges = byte_ranges(tensors, budget)
            if ranges:
                table = torch.tensor(ranges, dtype=torch.int64).to(device)
                nbytes = sum(n for _, n in ranges)
                plan = PrefetchPlan(table, nbytes, max_tokens, late, tuple(tensors))
                total += plan.nbytes
        attn.l2_prefetch = plan
    return total

"""Unmerged LoRA on linear layers: `y = base(x) + B_slot(t) @ A_slot(t) @ x` per token.

`LoRALinearMethod` wraps a layer's existing `LinearMethod` (unquantized or quantized) after the
model is built, so `pagoda/layers` knows nothing of adapters. Each wrapped layer holds stacked
slots `A [max_loras, S*R, in]` and `B [max_loras, out, S*R]` (S output shards, R the max rank;
shard j's pair sits in block j, B block-diagonal, the scale folded into B). `LoRABatch` is the
per-step segment -> slot table all layers share; its buffers are static for CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.lora.ops import (
    lora_grouped_ref,
    lora_sgmv,  # noqa: F401  (kept importable from here for callers that patch it)
    lora_shrink_expand,
)
from pagoda.kernels.lora.workspace import LoRAWorkspace, lora_workspace
from pagoda.layers.linear import LinearBase, LinearMethod


class LoRABatch:
    """Which adapter slot each part of the flat batch uses, shared by every LoRA layer.

    On CUDA, two layouts: one segment per request (`num_segs` set, eager steps), or one
    segment per token (`num_segs` None: CUDA graphs, whose captured kernels read the static
    `slots` buffer that each replay refills). The kernels read per-token slots either way
    (`token_slots`): the `slots` buffer itself per token, the request slots repeated per
    request. On the CPU, `groups` lists the token rows of each adapter slot, computed once per
    step instead of once per layer.
    """

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.starts = torch.zeros(max_num_tokens + 1, dtype=torch.int32, device=device)
        self._token_starts = torch.arange(max_num_tokens + 1, dtype=torch.int32, device=device)
        self._request_token_slots = torch.full_like(self.slots, -1)
        # split-K scratch of the shrink kernels, shared by all layers; allocated up front so
        # that no CUDA-graph capture allocates (and captures the zeroing of) it
        self._workspace: LoRAWorkspace | None = None
        if self.on_cuda:
            self._workspace = self.workspace
        self.num_segs: int | None = None
        self.max_seg_len = 1
        self.groups: list[tuple[int, slice | torch.Tensor]] = []  # (slot, rows), CPU only
        # False when no request of an eager step has an adapter: the LoRA terms are skipped.
        # Captured graphs always contain them (their slots say -1 when unused).
        self.active = True

    def segments(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(starts, slots, num_segs, max_seg_len) for a layer input of `num_tokens` rows."""
        if self.num_segs is None:
            return self._token_starts, self.slots, num_tokens, 1
        return self.starts, self.slots, self.num_segs, self.max_seg_len

    def token_slots(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens] int32 adapter slot of each row of a layer input (-1: none)."""
        if self.num_segs is None:
            return self.slots[:num_tokens]
        return self._request_token_slots[:num_tokens]

    @property
    def workspace(self) -> LoRAWorkspace:
        if self._workspace is None:
            self._workspace = lora_workspace(self.device, max_rows=min(self.max_num_tokens, 1024))
        return self._workspace

    def set_per_request(self, slots: list[int], num_tokens: list[int]) -> None:
        starts = [0]
        for count in num_tokens:
            starts.append(starts[-1] + count)
        self.active = any(s >= 0 for s in slots)
        if not self.on_cuda:
            self.groups = _groups(slots, starts) if self.active else []
            return
        n = len(slots)
        self.starts[: n + 1].copy_(_pinned(starts), non_blocking=True)
        self.slots[:n].copy_(_pinned(slots), non_blocking=True)
        if self.active:
            # -1 past the requests: rows a runner may pad the layer input with get no adapter
            per_token = torch.full((self.max_num_tokens,), -1, dtype=torch.int32)
            per_token[: starts[-1]] = torch.repeat_interleave(
                torch.tensor(slots, dtype=torch.int32), torch.tensor(num_tokens)
            )
            self._request_token_slots.copy_(_pin_tensor(per_token), non_blocking=True)
        self.num_segs = n
        self.max_seg_len = max(num_tokens)

    def set_per_token(self, slots: list[int], padded: int) -> None:
        """One token per request (decode); rows `len(slots)..padded` are padding (-1)."""
        padding = [-1] * (padded - len(slots))
        self.slots[:padded].copy_(_pinned(slots + padding), non_blocking=True)
        self.num_segs = None
        self.max_seg_len = 1
        self.active = True


def _pinned(values: list[int]) -> torch.Tensor:
    # Pinned, so that the non-blocking copy to the GPU is really asynchronous.
    return torch.tensor(values, dtype=torch.int32).pin_memory()


def _pin_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


def _groups(slots: list[int], starts: list[int]) -> list[tuple[int, slice | torch.Tensor]]:
    """Token rows per adapter slot: a slice when they are contiguous, else an index tensor."""
    rows: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(i)
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, segs in rows.items():
        if segs[-1] - segs[0] == len(segs) - 1:
            groups.append((slot, slice(starts[segs[0]], starts[segs[-1] + 1])))
        else:
            idx = [t for i in segs for t in range(starts[i], starts[i + 1])]
            groups.append((slot, torch.tensor(idx, dtype=torch.long)))
    return groups


class LoRALinearMethod(LinearMethod):
    """The wrapped method's output plus the low-rank terms of each token's adapter."""

    def __init__(
        self,
        inner: LinearMethod,
        layer: LinearBase,
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.inner = inner
        self.batch = batch
        self.max_rank = max_rank
        self.shard_sizes = list(layer.out_features_per_shard)
        self.shard_offsets = [sum(self.shard_sizes[:j]) for j in range(len(self.shard_sizes))]
        num_shards = len(self.shard_sizes)
        # [max_loras, S*R, in] and [max_loras, out, S*R]; zero rows/columns where an adapter's
        # rank is below R or it does not target a shard, so they add nothing.
        self.lora_a = torch.zeros(
            max_loras, num_shards * max_rank, layer.in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            max_loras, layer.out_features, num_shards * max_rank, dtype=dtype, device=device
        )

    def create_weights(self, *args, **kwargs) -> None:
        raise RuntimeError("LoRALinearMethod wraps a built layer; it creates no weights")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def set_slot(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load one adapter's (A [r, in], scaled B [n_j, r]) per shard into `slot`."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, pair in enumerate(shards):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            rank0 = j * self.max_rank
            self.lora_a[slot, rank0 : rank0 + r].copy_(a, non_blocking=True)
            out0 = self.shard_offsets[j]
            self.lora_b[slot, out0 : out0 + self.shard_sizes[j], rank0 : rank0 + r].copy_(
                b, non_blocking=True
            )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.inner.apply(layer, x, bias)  # [T, out]
        if not self.batch.active:
            return y
        if not self.batch.on_cuda:
            return lora_grouped_ref(x, self.lora_a, self.lora_b, self.batch.groups, y)
        # shrink: [T, in] x A[slot]^T -> [T, S*R] (split over K); expand: += [T, S*R] x
        # B[slot]^T into y. Two launches, per-token slots, no host sync.
        token_slots = self.batch.token_slots(x.shape[0])
        return lora_shrink_expand(x, self.lora_a, self.lora_b, token_slots, y, self.batch.workspace)

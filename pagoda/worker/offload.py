"""CPU weight offload (`cpu_offload_gb`, vLLM's name and meaning): that many GiB of decoder-layer
weights live in pinned host memory and are copied to the device layer by layer, just in time.

Offloaded layers are spread evenly over the stack so that resident layers run while the next
offloaded one is copied. Two device staging buffers, each the size of the largest offloaded
layer, alternate: while layer i computes from one, a side stream copies layer i+1 into the other
(events order the copy after the buffer's previous reader and the compute after the copy).
Host-side control (hooks that rebind the layer's tensors) makes it incompatible with CUDA-graph
replay, so the runner runs eagerly when offloading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

GiB = 1 << 30


@dataclass(frozen=True)
class OffloadPlan:
    layer_indices: tuple[int, ...]  # decoder layers whose weights stay on the host
    offload_bytes: int  # their bytes (>= what was asked, by less than one layer)
    layer_bytes: tuple[int, ...]  # bytes of every decoder layer, in order


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layer list (`model.layers` or `model.language_model.layers`)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, module)
    if best is None:
        raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no decoder layer list")
    return best[1]


def _layer_tensors(layer: nn.Module, shared: set[int]) -> list[tuple[nn.Module, str, str]]:
    """(module, kind, name) of every parameter and buffer owned by this layer alone; `shared`
    holds ids of tensors that other layers use too (the rotary tables every layer points at).
    Plain tensor attributes are state, not weights (the KV cache the runner binds)."""
    out, seen = [], set()
    for module in layer.modules():
        items = [("param", n, t) for n, t in module._parameters.items()]
        items += [("buffer", n, t) for n, t in module._buffers.items()]
        for kind, name, t in items:
            if t is None or id(t) in shared or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((module, kind, name))
    return out


def _get(module: nn.Module, kind: str, name: str) -> torch.Tensor:
    return module._parameters[name] if kind == "param" else module._buffers[name]


def _set(module: nn.Module, kind: str, name: str, value: torch.Tensor) -> None:
    if kind == "param":
        module._parameters[name].data = value
    else:
        module._buffers[name] = value


def _shared_ids(layers: nn.ModuleList) -> set[int]:
    counts: dict[int, int] = {}
    for layer in layers:
        ids = {id(t) for t in list(layer.parameters()) + list(layer.buffers())}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
    return {i for i, c in counts.items() if c > 1}


def plan_offload(layers: nn.ModuleList, cpu_offload_gb: float) -> OffloadPlan:
    """The fewest decoder layers whose weights add up to `cpu_offload_gb` GiB, evenly spaced."""
    shared = _shared_ids(layers)
    sizes = []
    for layer in layers:
        tensors = [_get(*e) for e in _layer_tensors(layer, shared)]
        sizes.append(sum(t.numel() * t.element_size() for t in tensors))
    want = int(cpu_offload_gb * GiB)
    if want > sum(sizes):
        raise ValueError(
            f"cpu_offload_gb={cpu_offload_gb} is more than the decoder layers' weights "
            f"({sum(sizes) / GiB:.2f} GiB); use at most that"
        )
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    count, total = 0, 0
    while total < want:  # layers are near-equal in size: take the largest first
        total += sizes[order[count]]
        count += 1
    if count == 0:
        return OffloadPlan((), 0, tuple(sizes))
    # Evenly spaced: layer k of `count` sits in the middle of its share of the stack.
    n = len(sizes)
    picked = sorted({min(n - 1, math.floor((k + 0.5) * n / count)) for k in range(count)})
    return OffloadPlan(tuple(picked), sum(sizes[i] for i in picked), tuple(sizes))


class LayerOffloader:
    """Holds the offloaded layers' weights on the host and streams them in per forward."""

    def __init__(self, layers: nn.ModuleList, plan: OffloadPlan, device: torch.device) -> None:
        self.device = device
        self.plan = plan
        self.cuda = device.type == "cuda"
        shared = _shared_ids(layers)
        self.entries: list[list[tuple[nn.Module, str, str]]] = []
        self.host: list[list[torch.Tensor]] = []  # pinned on CUDA machines
        self.offsets: list[list[int]] = []  # byte offset of each tensor in a staging buffer
        largest = 0
        for i in plan.layer_indices:
            entries = _layer_tensors(layers[i], shared)
            host, offsets, off = [], [], 0
            for e in entries:
                t = _get(*e).detach()
                t = t.to("cpu")
                if self.cuda:
                    t = t.pin_memory()
                host.append(t)
                offsets.append(off)
                off += -(-t.numel() * t.element_size() // 256) * 256  # aligned views
                _set(*e, torch.empty(0, dtype=t.dtype, device=device))  # no device copy left
            largest = max(largest, off)
            self.entries.append(entries)
            self.host.append(host)
            self.offsets.append(offsets)
        self.buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready: list[torch.cuda.Event | None] = [None] * len(self.entries)
        self.buffer_free: list[torch.cuda.Event | None] = [None, None]
        self.copies = 0  # layers copied in (tests: the mechanism ran)
        self.handles = []
        for k, i in enumerate(plan.layer_indices):
            self.handles.append(layers[i].register_forward_pre_hook(self._pre_hook(k)))
            self.handles.append(layers[i].register_forward_hook(self._post_hook(k)))

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for host in self.host for t in host)

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _slot(self, k: int) -> int:
        return k % 2

    def _prefetch(self, k: int) -> None:
        """Copy offloaded layer k into its staging buffer (on the side stream on CUDA)."""
        slot = self._slot(k)
        buf = self.buffers[slot]
        if self.cuda:
            stream = self.copy_stream
            if self.buffer_free[slot] is not None:
                stream.wait_event(self.buffer_free[slot])  # its last reader has run
            with torch.cuda.stream(stream):
                self._copy_into(k, buf)
                event = torch.cuda.Event()
                event.record(stream)
            self.ready[k] = event
        else:
            self._copy_into(k, buf)
            self.ready[k] = None
        self.copies += 1

    def _copy_into(self, k: int, buf: torch.Tensor) -> None:
        for t, off in zip(self.host[k], self.offsets[k], strict=True):
            nbytes = t.numel() * t.element_size()
            view = buf[off : off + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=self.cuda)

    def _bind(self, k: int) -> None:
        buf = self.buffers[self._slot(k)]
        for e, t, off in zip(self.entries[k], self.host[k], self.offsets[k], strict=True):
            nbytes = t.numel() * t.element_size()
            _set(*e, buf[off : off + nbytes].view(t.dtype).view(t.shape))

    def _pre_hook(self, k: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._pending != k:
                self._prefetch(k)  # the first step, or layers run out of their order
            if self.cuda and self.ready[k] is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready[k])
            self._bind(k)
            self._pending = None
            if k + 1 < len(self.entries):  # the other buffer: its last reader was layer k - 1
                self._prefetch(k + 1)  # overlaps this layer and the resident ones after it
                self._pending = k + 1

        return hook

    def _post_hook(self, k: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if self.cuda:  # the buffer is free once what was just enqueued has run
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self.buffer_free[self._slot(k)] = event
            if k == len(self.entries) - 1:
                # The next step's first offloaded layer, behind the rest of this step.
                self._prefetch(0)
                self._pending = 0

        return hook

    _pending: int | None = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.buffers = []
        self.host = []
        self.entries = []

"""Step inputs to the device through one persistent pinned buffer.

A host → device copy that must not wait for the device (the host prepares step N + 1 while step
N runs) needs page-locked memory. `Tensor.pin_memory()` per array allocates from the pinned
caching allocator and asks the driver whether the source is pinned: tens of µs each, and a step
stages a dozen arrays. `PinnedStaging` instead writes each array into a region of a pinned
buffer allocated once and copies from there.

The buffer is a ring of `slots` regions; a step takes the next region (`next_step`). The host
may overwrite a region only once the copies read from it have run on the device, so each
region keeps a CUDA event recorded when its step ends (the start of the next step), and a step
taking a region waits for that event — in steady state long passed, since the engine keeps at
most two steps in flight. An array that does not fit the rest of its region is staged the old
way (its own pinned copy).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64  # bytes: each staged array starts on a cache line


class PinnedStaging:
    def __init__(self, device: torch.device, slot_bytes: int = 4 << 20, slots: int = 3) -> None:
        assert device.type == "cuda", "pinned staging is for host → CUDA copies"
        assert slots >= 2 and slot_bytes % _ALIGN == 0
        self.device = device
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.buffer = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.slot = 0
        self.offset = 0
        self.num_fallbacks = 0  # arrays that did not fit their region

    def next_step(self) -> None:
        """Close the current region (its copies are enqueued) and take the next one, waiting
        until the device has run the copies that last read from it."""
        event = self.events[self.slot]
        if event is None:
            event = self.events[self.slot] = torch.cuda.Event()
        event.record()
        self.slot = (self.slot + 1) % self.slots
        nxt = self.events[self.slot]
        if nxt is not None:
            nxt.synchronize()
        self.offset = 0

    def stage(self, arr: np.ndarray) -> torch.Tensor:
        """A pinned host tensor holding `arr`'s values, valid until this region is reused."""
        src = torch.from_numpy(np.ascontiguousarray(arr))
        nbytes = src.numel() * src.element_size()
        start = -(-self.offset // _ALIGN) * _ALIGN
        if start + nbytes > self.slot_bytes:
            self.num_fallbacks += 1
            return src.pin_memory()
        base = self.slot * self.slot_bytes + start
        host = self.buffer[base : base + nbytes].view(src.dtype).view(src.shape)
        host.copy_(src)
        self.offset = start + nbytes
        return host

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        """`arr` on the device; the copy is enqueued on the current stream (no host wait)."""
        return self.stage(arr).to(self.device, non_blocking=True)

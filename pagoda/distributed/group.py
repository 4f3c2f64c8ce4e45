"""One tensor-parallel rank's view of its process group and the collectives the model runs.

Process groups are built directly on a `TCPStore` (no `init_process_group`), so no global state
is set and several engines, one after the other, can live in one process. Tensors go through
NCCL on CUDA and gloo on the CPU; a second gloo group carries host-side checks (the KV cache
size every rank agrees on). A peer that dies makes the next collective raise (gloo sees the
closed connection); `timeout_s` bounds a collective that waits on a stuck peer.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0's store listens; what a spawned rank needs to join."""

    host: str
    port: int
    world_size: int
    timeout_s: float

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def create_store(world_size: int, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's store on a free port the OS picks (read it back from `.port`)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)


@dataclass
class TensorParallelGroup:
    """The rank, the world size and the process groups of one tensor-parallel rank."""

    rank: int
    world_size: int
    device: torch.device
    store: Any  # dist.TCPStore: kept alive as long as the groups
    pg: Any  # tensors on `device` (NCCL on CUDA, gloo on the CPU)
    cpu_pg: Any  # gloo, host tensors
    closed: bool = field(default=False)

    @classmethod
    def join(
        cls,
        address: GroupAddress,
        rank: int,
        device: torch.device,
        store: dist.TCPStore | None = None,
    ) -> TensorParallelGroup:
        """Connect rank `rank` (rank 0 passes the store it created)."""
        if not 0 <= rank < address.world_size:
            raise ValueError(f"rank {rank} outside a world of {address.world_size}")
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(
                address.host, address.port, address.world_size, is_master=False, timeout=timeout
            )
        cpu_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("cpu/", store), rank, address.world_size, timeout
        )
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("dev/", store), rank, address.world_size, opts
            )
        else:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore("dev/", store), rank, address.world_size, timeout
            )
        return cls(rank, address.world_size, device, store, pg, cpu_pg)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        self.pg.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], rank order along the last dimension."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (host-side agreement, e.g. KV blocks)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.cpu_pg.allreduce([t], _min_opts()).wait()
        return int(t.item())

    def close(self) -> None:
        """Release both process groups (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for pg in (self.pg, self.cpu_pg):
            shutdown = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
            if shutdown is not None:
                # A peer already gone leaves nothing to release on its side.
                with contextlib.suppress(RuntimeError):
                    shutdown()
        self.pg = self.cpu_pg = None
        self.store = None


def _min_opts() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts

"""Device memory accounting: how much the weights take and how many KV blocks fit.

The engine measures in-process (no log reading): weights are what the allocator holds after
loading, activations the peak of a profiling forward at the largest batch, and the KV cache gets
what is left of `gpu_memory_utilization × total` (or exactly `kv_cache_memory` bytes). On CPUs
and on integrated GPUs that share system RAM (Jetson), the budget comes from available system
memory rather than the device's reported total, which would count memory the OS is using.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

GiB = 1 << 30


@dataclass
class MemoryReport:
    """What the engine holds in memory, measured at start-up."""

    device: str
    dtype: str
    weights_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    num_blocks: int  # usable blocks (the null block excluded)
    block_size: int
    max_model_len: int
    total_memory_bytes: int
    memory_budget_bytes: int  # what the engine allowed itself (utilization × total, or the cap)
    load_time_s: float
    profile_time_s: float = 0.0
    cuda_graph_capture_time_s: float = 0.0
    cuda_graph_bytes: int = 0
    cuda_graph_sizes: list[int] = field(default_factory=list)
    integrated_gpu: bool = False
    # CUDA: what the device held before this engine loaded (other processes, the CUDA
    # context, earlier engines); it comes off the budget (docs/memory.md).
    in_use_at_start_bytes: int = 0
    # Weights kept in pinned host memory and streamed per layer (cpu_offload_gb).
    cpu_offload_bytes: int = 0
    offloaded_layers: int = 0
    # Vision-language models: the vision encoder's weights (inside weights_bytes) and its
    # activation peak on the largest input the limits allow (inside peak activations).
    encoder_weights_bytes: int = 0
    encoder_activation_bytes: int = 0
    encoder_profile_input: str = ""
    # Start-up: seconds from LLM(...) to ready, and the Triton kernels compiled meanwhile
    # (0: a warm cache; None: Triton not in use). Filled in by the engine.
    startup_time_s: float = 0.0
    triton_kernels_compiled: int | None = None

    @property
    def kv_token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of `max_model_len` tokens fit in the KV cache at once."""
        return self.kv_token_capacity / self.max_model_len

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            weights_gib=self.weights_bytes / GiB,
            peak_activation_gib=self.peak_activation_bytes / GiB,
            kv_cache_gib=self.kv_cache_bytes / GiB,
            kv_token_capacity=self.kv_token_capacity,
            max_concurrency=self.max_concurrency,
            cuda_graph_gib=self.cuda_graph_bytes / GiB,
        )
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        rows = [
            ("device", f"{self.device} ({self.dtype})"),
            ("weights", f"{self.weights_bytes / GiB:.3f} GiB (loaded in {self.load_time_s:.2f} s)"),
            ("peak activations", f"{self.peak_activation_bytes / GiB:.3f} GiB"),
            (
                "KV cache",
                f"{self.kv_cache_bytes / GiB:.3f} GiB = {self.num_blocks} blocks of "
                f"{self.block_size} tokens",
            ),
            ("KV token capacity", f"{self.kv_token_capacity:,} tokens"),
            (
                "max concurrency",
                f"{self.max_concurrency:.2f}x at max_model_len={self.max_model_len}",
            ),
        ]
        if self.encoder_weights_bytes:
            rows.append(
                (
                    "vision encoder",
                    f"{self.encoder_weights_bytes / GiB:.3f} GiB weights, "
                    f"{self.encoder_activation_bytes / GiB:.3f} GiB activations for "
                    f"{self.encoder_profile_input}",
                )
            )
        if self.cuda_graph_sizes:
            rows.append(
                (
                    "CUDA graphs",
                    f"{len(self.cuda_graph_sizes)} sizes in "
                    f"{self.cuda_graph_capture_time_s:.2f} s, "
                    f"{self.cuda_graph_bytes / GiB:.3f} GiB",
                )
            )
        if self.in_use_at_start_bytes:
            rows.append(("in use at start", f"{self.in_use_at_start_bytes / GiB:.3f} GiB"))
        if self.cpu_offload_bytes:
            rows.append(
                (
                    "CPU offload",
                    f"{self.cpu_offload_bytes / GiB:.3f} GiB of weights in host memory "
                    f"({self.offloaded_layers} layers streamed)",
                )
            )
        if self.startup_time_s:
            if self.triton_kernels_compiled is None:
                cache = ""
            elif self.triton_kernels_compiled:
                cache = f", cold: {self.triton_kernels_compiled} Triton kernels compiled"
            else:
                cache = ", warm Triton cache"
            rows.append(("start-up", f"{self.startup_time_s:.2f} s{cache}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def system_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to total physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, elem_size: int
) -> int:
    """K and V for one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem_size


def blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return max(0, budget_bytes // bytes_per_block)

"""Shared pieces of the benchmark scripts: workloads, ceilings, baselines and result files.

Every benchmark reports a ratio measured in the same run: against transformers on the same
model shape, or against the device's copy bandwidth measured right before.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(
    num_requests: int,
    min_len: int,
    max_len: int,
    min_out: int,
    max_out: int,
    vocab: int,
    seed: int = 0,
) -> Workload:
    """The nano-vllm protocol: prompt and output lengths uniform in a range, random ids."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(0, min(vocab, 10000)) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    outs = [rng.randint(min_out, max_out) for _ in range(num_requests)]
    return Workload(prompts, outs)


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    if device.type != "cuda":
        return float("nan")
    n = nbytes // 2
    src = torch.randn(n // 2, dtype=torch.float32, device=device)
    src = src.view(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    t = times[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / t / 1  # elements * 2 bytes, read + write


def wall_time_per_call(fn, iters: int) -> float:
    """Seconds per call of `fn()` on CUDA, host work included: one warm-up call, then `iters`
    calls between two synchronisations."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def graph_time_per_call(fn, copies: int, replays: int = 20, reps: int = 5) -> float:
    """Seconds per call of `fn(i)` for i in range(copies), all captured in one CUDA graph and
    replayed `replays` times (median of `reps` timings): back-to-back kernels as in a decode
    graph, with `copies` weight copies so that each call reads from HBM, not the L2."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles, sizes workspaces) outside the capture
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / (replays * copies))
    del g
    return sorted(times)[len(times) // 2]


def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def hf_model_from_config(hf_config: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A transformers model with random weights of the same shape, on the device."""
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import transformers_config

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(transformers_config(hf_config), dtype=dtype)
    return model.eval()


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_device(script: str) -> torch.device:
    """The CUDA device a GPU-only benchmark runs on; without one, exit with a message (2)."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    return torch.device("cuda")


def write_result(out: str | None, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=2, default=str)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out}")


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> Timer:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.elapsed = time.perf_counter() - self.t0

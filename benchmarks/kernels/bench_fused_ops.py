"""Fused decoder ops (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul): Triton vs eager torch refs.

Times each kernel and its `*_ref` at several token counts on a model's shapes (Qwen2.5-7B by
default) with `do_bench` (eager launches) and `do_bench_cudagraph` (graph replay, as decode runs;
free of host launch overhead, so GB/s against a measured device copy is computed from it).
Usage: python benchmarks/kernels/bench_fused_ops.py [--tokens 1 64 8192] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from pagoda.kernels.norm_act.ops import (
    apply_rotary_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from pagoda.kernels.norm_act.triton_fused_ops import (
    apply_rotary_triton,
    fused_add_rms_norm_triton,
    rms_norm_triton,
    silu_and_mul_triton,
)
from pagoda.layers.rotary import RotaryEmbedding

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-7b.json"


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write), the ceiling for memory-bound kernels."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def make_cases(cfg: dict, num_tokens: int, dtype: torch.dtype) -> list[dict]:
    """Each case: name, the fused fn, the eager reference fn, and the bytes a pass must move."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_heads, k_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // q_heads
    max_pos, eps = cfg["max_position_embeddings"], cfg["rms_norm_eps"]
    es = torch.finfo(dtype).bits // 8
    dev = "cuda"

    x = torch.randn(num_tokens, hidden, dtype=dtype, device=dev)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=dev)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=dev)
    rope = RotaryEmbedding(head_dim, max_pos, cfg.get("rope_theta", 1e4)).to(dev)
    positions = torch.randint(0, max_pos, (num_tokens,), device=dev)
    # q and k as the attention layer passes them: column slices of the fused QKV output.
    q_size, kv_size = q_heads * head_dim, k_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=dev)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rope.cos_cache, rope.sin_cache
    gate_up = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=dev)

    tokens_x_hidden = num_tokens * hidden * es
    return [
        {
            "op": "rms_norm",
            "fused": lambda: rms_norm_triton(x, weight, eps),
            "ref": lambda: rms_norm_ref(x, weight, eps),
            "bytes": 2 * tokens_x_hidden + hidden * es,
        },
        {
            "op": "fused_add_rms_norm",
            "fused": lambda: fused_add_rms_norm_triton(x, residual, weight, eps),
            "ref": lambda: fused_add_rms_norm_ref(x, residual, weight, eps),
            "bytes": 4 * tokens_x_hidden + hidden * es,
        },
        {
            "op": "apply_rotary",
            "fused": lambda: apply_rotary_triton(positions, q, k, cos, sin, head_dim),
            "ref": lambda: apply_rotary_ref(positions, q, k, cos, sin, head_dim),
            # q and k read and written in place; one float32 cos and sin row and a position per
            # token.
            "bytes": num_tokens * (2 * (q_size + kv_size) * es + head_dim * 4 + 8),
        },
        {
            "op": "silu_and_mul",
            "fused": lambda: silu_and_mul_triton(gate_up),
            "ref": lambda: silu_and_mul_ref(gate_up),
            "bytes": 3 * num_tokens * inter * es,
        },
    ]


def time_fn(fn: Callable[[], object], graph_reps: int) -> tuple[float, float]:
    """(µs with do_bench, µs per replay inside a CUDA graph)."""
    fn()  # compile / warm the allocator outside the graph capture
    torch.cuda.synchronize()
    eager_us = do_bench(fn, warmup=25, rep=100) * 1e3
    graph_us = do_bench_cudagraph(fn, rep=graph_reps) * 1e3
    return eager_us, graph_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="HF config.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_ops needs a CUDA GPU")

    cfg = json.loads(args.config.read_text())
    dtype = getattr(torch, args.dtype)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s")
    header = f"{'op':<20}{'T':>6}  {'impl':<7}{'do_bench us':>12}{'graph us':>10}{'GB/s':>8}"
    print(header + f"{'of copy':>9}{'speedup':>9}")

    rows = []
    for num_tokens in args.tokens:
        for case in make_cases(cfg, num_tokens, dtype):
            timings = {}
            for impl in ("fused", "ref"):
                eager_us, graph_us = time_fn(case[impl], graph_reps=50)
                # Graph replay: Python launch overhead can exceed a 30 us kernel under do_bench.
                # At T=8192 the data (>100 MB) is larger than the L2, so this is DRAM traffic.
                gbs = case["bytes"] / (graph_us * 1e-6) / 1e9
                timings[impl] = graph_us
                rows.append(
                    {
                        "op": case["op"],
                        "num_tokens": num_tokens,
                        "impl": "triton" if impl == "fused" else "torch_ref",
                        "do_bench_us": eager_us,
                        "graph_us": graph_us,
                        "bytes": case["bytes"],
                        "gbs": gbs,
                        "frac_of_copy": gbs / copy_gbs,
                    }
                )
                r = rows[-1]
                line = f"{case['op']:<20}{num_tokens:>6}  {r['impl'][:7]:<7}"
                line += f"{eager_us:>12.1f}{graph_us:>10.1f}{gbs:>8.0f}{gbs / copy_gbs:>9.0%}"
                if impl == "ref":
                    line += f"{timings['ref'] / timings['fused']:>8.1f}x"
                print(line)
        torch.cuda.empty_cache()

    # What one decode step spends on these ops: per layer two add+norms, one RoPE, one SiLU.
    per_layer = {"fused_add_rms_norm": 2, "apply_rotary": 1, "silu_and_mul": 1}
    layers = cfg["num_hidden_layers"]
    summary = {}
    for impl in ("triton", "torch_ref"):
        summary[impl] = layers * sum(
            n * r["graph_us"]
            for r in rows
            if r["num_tokens"] == min(args.tokens) and r["impl"] == impl
            for op, n in per_layer.items()
            if r["op"] == op
        )
    print(
        f"per decode step at T={min(args.tokens)} ({layers} layers, CUDA graph): "
        f"triton {summary['triton']:.0f} us vs torch {summary['torch_ref']:.0f} us"
    )

    if args.out:
        result = {
            "benchmark": "fused_ops",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "config": str(args.config),
            "dtype": args.dtype,
            "copy_bandwidth_gbs": copy_gbs,
            "rows": rows,
            "decode_step_us": summary,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

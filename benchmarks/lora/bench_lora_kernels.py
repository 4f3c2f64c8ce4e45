"""LoRA kernels alone: shrink + expand per linear against the base bf16 matmul, in CUDA graphs.

For each projection of a decoder layer (Qwen2.5-3B by default: qkv 2048->2560 with 3 shards,
o 2048->2048, gate_up 2048->22016 with 2 shards, down 11008->2048) and each token count, one
CUDA graph holds the op once per decoder layer (`--layers` separate weight copies, so nothing
stays in L2 from one call to the next, as in a real step); it is replayed `--replays` times
between two CUDA events. Columns, in us per linear:

  base      the bf16 matmul x @ W^T (what the merged model pays)
  lora      shrink + expand, `lora_shrink_expand_triton` (what unmerged LoRA adds)
  shrink    x @ A[slot]^T -> rank space (split-K), alone
  expand    y += rank @ B[slot]^T, alone
  nosplit   lora with the shrink not split over K (with --nosplit)
  torch2mm  one adapter as two cuBLAS matmuls (x @ A^T) @ B^T added into y (a floor for
            "two launches")

and a per-step estimate: the LoRA cost of the four linears times the number of layers.

    python benchmarks/lora/bench_lora_kernels.py [--tokens 1,16,64] [--adapters 1] [--nosplit]

Without CUDA, `--smoke` runs tiny shapes eagerly (TRITON_INTERPRET=1) to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-3b.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config.json of the model")
    p.add_argument("--tokens", default="1,16,64", help="comma-separated token counts")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots in the weights")
    p.add_argument("--adapters", type=int, default=1, help="adapters in use, token t: t %% n")
    p.add_argument("--layers", type=int, default=36, help="weight copies (decoder layers)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--nosplit", action="store_true", help="also time the unsplit shrink")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, eager, any device")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p.parse_args(argv)


def projection_shapes(cfg: dict, rank: int) -> dict[str, tuple[int, int, int]]:
    """name -> (in, out, S*R) of the fused LoRA linears of one decoder layer."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    return {
        "qkv": (hidden, (heads + 2 * kv) * head_dim, 3 * rank),
        "o": (heads * head_dim, hidden, rank),
        "gate_up": (hidden, 2 * inter, 2 * rank),
        "down": (inter, hidden, rank),
    }


def time_graph(fns: list[Callable[[], object]], replays: int) -> float:
    """Microseconds per fn: all of `fns` captured in one CUDA graph, replayed."""
    for fn in fns[:2]:
        fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * len(fns))
    del graph
    return us


def time_eager(fns: list[Callable[[], object]], replays: int) -> float:
    fns[0]()
    t0 = time.perf_counter()
    for _ in range(replays):
        for fn in fns:
            fn()
    return (time.perf_counter() - t0) * 1e6 / (replays * len(fns))


def bench_shape(
    n_in: int, n_out: int, rank_space: int, num_tokens: int, ns: argparse.Namespace, device: str
) -> dict:
    from pagoda.kernels.lora import lora_workspace
    from pagoda.kernels.triton_lora import (
        choose_config,
        lora_gemm_triton,
        lora_shrink_expand_triton,
    )

    dtype = torch.bfloat16
    timer = time_graph if device == "cuda" else time_eager
    layers = ns.layers
    x = torch.randn(num_tokens, n_in, device=device).to(dtype)
    weights = [
        torch.empty(n_out, n_in, dtype=dtype, device=device).normal_(0, 0.02) for _ in range(layers)
    ]
    a = [
        torch.empty(ns.max_loras, rank_space, n_in, dtype=dtype, device=device).normal_(0, 0.02)
        for _ in range(layers)
    ]
    b = [
        torch.empty(ns.max_loras, n_out, rank_space, dtype=dtype, device=device).normal_(0, 0.02)
        for _ in range(layers)
    ]
    y = torch.zeros(num_tokens, n_out, dtype=dtype, device=device)
    rank = torch.randn(num_tokens, rank_space, device=device).to(dtype)  # the expand's input
    slots = torch.tensor(
        [t % ns.adapters for t in range(num_tokens)], dtype=torch.int32, device=device
    )
    workspace = lora_workspace(device)
    shrink_cfg = choose_config(num_tokens, rank_space, n_in, workspace_ok=True)
    expand_cfg = choose_config(num_tokens, n_out, rank_space, workspace_ok=False)

    def each(fn: Callable[[int], object]) -> list[Callable[[], object]]:
        return [lambda i=i: fn(i) for i in range(layers)]

    row: dict = {"tokens": num_tokens, "in": n_in, "out": n_out, "rank_space": rank_space}
    row["base"] = timer(each(lambda i: torch.nn.functional.linear(x, weights[i])), ns.replays)
    row["lora"] = timer(
        each(lambda i: lora_shrink_expand_triton(x, a[i], b[i], slots, y, workspace)),
        ns.replays,
    )
    row["shrink"] = timer(
        each(lambda i: lora_gemm_triton(x, a[i], slots, rank, False, workspace)), ns.replays
    )
    row["expand"] = timer(
        each(lambda i: lora_gemm_triton(rank, b[i], slots, y, True, None)), ns.replays
    )
    if ns.nosplit:
        nosplit = choose_config(num_tokens, rank_space, n_in, workspace_ok=False)
        row["nosplit"] = timer(
            each(
                lambda i: lora_shrink_expand_triton(
                    x, a[i], b[i], slots, y, workspace, shrink_config=nosplit
                )
            ),
            ns.replays,
        )
    row["torch2mm"] = timer(each(lambda i: y.addmm_(x @ a[i][0].T, b[i][0].T)), ns.replays)
    row["shrink_config"] = {
        "block_m": shrink_cfg.block_m,
        "block_n": shrink_cfg.block_n,
        "block_k": shrink_cfg.block_k,
        "split_k": shrink_cfg.split_k,
        "num_warps": shrink_cfg.num_warps,
    }
    row["expand_config"] = {
        "block_m": expand_cfg.block_m,
        "block_n": expand_cfg.block_n,
        "block_k": expand_cfg.block_k,
        "num_warps": expand_cfg.num_warps,
    }
    assert torch.isfinite(y).all()
    assert not workspace.acc.any() and not workspace.counters.any(), "workspace left dirty"
    return row


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not ns.smoke:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1
    cfg = json.loads(Path(ns.config).read_text())
    shapes = projection_shapes(cfg, ns.rank)
    num_layers = cfg.get("num_hidden_layers", ns.layers)
    tokens = [int(t) for t in ns.tokens.split(",")]
    if ns.smoke:
        shapes = {"qkv": (64, 80, 3 * 4), "down": (96, 32, 4)}
        tokens, ns.layers, ns.replays, ns.max_loras = [1, 3], 2, 2, 2
    ns.adapters = max(1, min(ns.adapters, ns.max_loras))

    t_start = time.perf_counter()
    rows = []
    cols = ["base", "lora", "shrink", "expand"] + (["nosplit"] if ns.nosplit else [])
    cols.append("torch2mm")
    print(
        f"LoRA kernels, rank {ns.rank}, {ns.adapters} adapter(s) in use of {ns.max_loras} slots,"
        f" {ns.layers} weight copies per graph; us per linear"
    )
    header = f"{'linear':<8}{'T':>5}" + "".join(f"{c:>10}" for c in cols)
    print(header + f"{'lora/base':>11}  shrink cfg (BM,BN,BK,split)")
    for t in tokens:
        for name, (n_in, n_out, rank_space) in shapes.items():
            row = bench_shape(n_in, n_out, rank_space, t, ns, device)
            row["linear"] = name
            rows.append(row)
            sc = row["shrink_config"]
            print(
                f"{name:<8}{t:>5}"
                + "".join(f"{row[c]:>10.1f}" for c in cols)
                + f"{row['lora'] / row['base']:>10.2f}x"
                + f"  ({sc['block_m']},{sc['block_n']},{sc['block_k']},{sc['split_k']})",
                flush=True,
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"\nper decode step, {num_layers} layers x the four linears:")
    for t in tokens:
        sel = [r for r in rows if r["tokens"] == t]
        base = sum(r["base"] for r in sel) * num_layers / 1e3
        lora = sum(r["lora"] for r in sel) * num_layers / 1e3
        print(f"  T={t:<4} base linears {base:7.3f} ms   LoRA adds {lora:7.3f} ms")
    print(f"(took {time.perf_counter() - t_start:.1f} s)")
    if ns.out:
        result = {"benchmark": "lora_kernels", "args": vars(ns), "rows": rows}
        if device == "cuda":
            result["device"] = torch.cuda.get_device_name()
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

and a per-step estimate: the LoRA cost of the four linears times the number of layers. Every
variant is first checked against the torch reference; a launch that does not finish in 30 s
ends the process.

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


def wait_or_exit(what: str, timeout_s: float = 30.0) -> None:
    """Wait for the GPU; exit the process (which ends the CUDA context) if it hangs."""
    event = torch.cuda.Event()
    event.record()
    t0 = time.perf_counter()
    while not event.query():
        if time.perf_counter() - t0 > timeout_s:
            print(f"\n{what}: the GPU did not finish in {timeout_s:.0f} s, exiting", flush=True)
            os._exit(3)
        time.sleep(1e-3)


def time_graph(fns: list[Callable[[], object]], replays: int, what: str) -> float:
    """Microseconds per fn: all of `fns` captured in one CUDA graph, replayed."""
    for fn in fns[:2]:
        fn()  # compile / autotune outside the capture
    wait_or_exit(what)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    wait_or_exit(what)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    wait_or_exit(what)
    us = start.elapsed_time(end) * 1e3 / (replays * len(fns))
    del graph
    return us


def time_eager(fns: list[Callable[[], object]], replays: int, what: str) -> float:
    fns[0]()
    t0 = time.perf_counter()
    for _ in range(replays):
        for fn in fns:
            fn()
    return (time.perf_counter() - t0) * 1e6 / (replays * len(fns))


def _config_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("block_m", "block_n", "block_k", "split_k", "num_warps")}


def bench_shape(
    name: str,
    shape: tuple[int, int, int],
    num_tokens: int,
    ns: argparse.Namespace,
    device: str,
    columns: list[str],
) -> dict:
    """Times the `columns` of one linear at one token count (after checking the LoRA results
    against the torch reference)."""
    from pagoda.kernels.lora.ops import lora_shrink_expand_ref
    from pagoda.kernels.lora.triton_lora import (
        choose_config,
        lora_gemm_triton,
        lora_shrink_expand_triton,
    )
    from pagoda.kernels.lora.workspace import lora_workspace

    n_in, n_out, rank_space = shape
    dtype = torch.bfloat16
    timer = time_graph if device == "cuda" else time_eager
    layers = ns.layers
    x = torch.randn(num_tokens, n_in, device=device).to(dtype)
    weights = [
        torch.empty(n_out, n_in, dtype=dtype, device=device).normal_(0, 0.02)
        for _ in range(layers if "base" in columns else 0)
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
    what = f"{name} T={num_tokens}"

    def each(fn: Callable[[int], object]) -> list[Callable[[], object]]:
        return [lambda i=i: fn(i) for i in range(layers)]

    def lora(**kw) -> Callable[[int], object]:
        return lambda i: lora_shrink_expand_triton(x, a[i], b[i], slots, y, workspace, **kw)

    # correctness first: a wrong kernel's timing means nothing
    y0 = torch.randn(num_tokens, n_out, device=device).to(dtype)
    expected = lora_shrink_expand_ref(x, a[0], b[0], slots, y0.clone())
    got = lora_shrink_expand_triton(x, a[0], b[0], slots, y0.clone(), workspace)
    if device == "cuda":
        wait_or_exit(what)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)

    variants: dict[str, Callable[[int], object]] = {
        "base": lambda i: torch.nn.functional.linear(x, weights[i]),
        "lora": lora(),
        "shrink": lambda i: lora_gemm_triton(x, a[i], slots, rank, False, workspace),
        "expand": lambda i: lora_gemm_triton(rank, b[i], slots, y, True, None),
        "nosplit": lora(
            shrink_config=choose_config(num_tokens, rank_space, n_in, workspace_ok=False)
        ),
        "torch2mm": lambda i: y.addmm_(x @ a[i][0].T, b[i][0].T),
    }
    row: dict = {"linear": name, "tokens": num_tokens, "in": n_in, "out": n_out}
    row["rank_space"] = rank_space
    for col in columns:
        row[col] = timer(each(variants[col]), ns.replays, f"{what} {col}")
    row["shrink_config"] = _config_dict(shrink_cfg)
    row["expand_config"] = _config_dict(expand_cfg)
    assert torch.isfinite(y).all()
    dirty = workspace.acc.any() or workspace.counters.any()
    assert not dirty, "a launch left the workspace dirty"
    return row


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # nothing lost if a hang ends the process
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
    print(
        f"{'linear':<8}{'T':>5}" + "".join(f"{c:>10}" for c in cols) + f"{'lora/base':>11}", end=""
    )
    print("  shrink (BM,BN,BK,split) expand (BM,BN,BK)")
    for t in tokens:
        for name, shape in shapes.items():
            row = bench_shape(name, shape, t, ns, device, cols)
            rows.append(row)
            sc, ec = row["shrink_config"], row["expand_config"]
            print(
                f"{name:<8}{t:>5}"
                + "".join(f"{row[c]:>10.1f}" for c in cols)
                + f"{row['lora'] / row['base']:>10.2f}x"
                + f"  ({sc['block_m']},{sc['block_n']},{sc['block_k']},{sc['split_k']})"
                + f" ({ec['block_m']},{ec['block_n']},{ec['block_k']})",
                flush=True,
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"\nper decode step, {num_layers} layers x the four linears (two launches each):")
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

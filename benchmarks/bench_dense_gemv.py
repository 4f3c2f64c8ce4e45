"""Batch-1 (M = 1) bf16 GEMV: cuBLAS (`F.linear`) vs pagoda's Triton split-K GEMV, Qwen2.5-7B
and -3B decode shapes, with a sweep of tile configs; the fraction of the copy bandwidth each
reaches (measured in the same run).

Timing: each call reads a different copy of the weight (enough copies to exceed L2 several
times) inside a CUDA graph, so every call streams its weight from HBM and launch overhead is
the graph's, as in the engine's decode graphs.

    python benchmarks/bench_dense_gemv.py --out benchmarks/results/dense_gemv_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pagoda import platform
from pagoda.bench.common import copy_bandwidth
from pagoda.bench.common import graph_time_per_call as time_graph
from pagoda.kernels.dense.triton_gemv import DenseGemvConfig, _plan, gemv_bf16, gemv_ref

SHAPES = {
    "7b.qkv": (4608, 3584),
    "7b.o": (3584, 3584),
    "7b.gate_up": (37888, 3584),
    "7b.down": (3584, 18944),
    "3b.qkv": (2560, 2048),
    "3b.o": (2048, 2048),
    "3b.gate_up": (22016, 2048),
    "3b.down": (2048, 11008),
}


def candidates() -> list[DenseGemvConfig]:
    out = []
    for bn in (8, 16, 32):
        for bk in (256, 512):
            for split in (0, 1, 2, 4):
                out.append(DenseGemvConfig(bn, bk, split, 4, 3))
    for warps in (2, 8):
        for split in (0, 2):
            out.append(DenseGemvConfig(16, 512, split, warps, 3))
    out.append(DenseGemvConfig(16, 1024, 0, 8, 2))
    out.append(DenseGemvConfig(32, 256, 8, 4, 3))
    return out


def bench_shape(name: str, bw: float, num_sms: int) -> dict:
    dev = torch.device("cuda")
    n, k = SHAPES[name]
    nbytes = n * k * 2
    copies = max(4, min(64, (600 << 20) // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if "qkv" in name else None
    ref = gemv_ref(x, ws[0], bias).float()
    row = {"shape": name, "N": n, "K": k, "bias": bias is not None, "copies": copies}
    t = time_graph(lambda i: torch.nn.functional.linear(x, ws[i], bias), copies)
    row["cublas_us"] = t * 1e6
    row["cublas_bw_frac"] = nbytes / t / bw
    results = []
    for cfg in candidates():
        try:
            out = gemv_bf16(x, ws[0], bias, cfg).float()
            err = float((out - ref).abs().max())
            t = time_graph(lambda i, cfg=cfg: gemv_bf16(x, ws[i], bias, cfg), copies)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            print(f"  {name} {cfg}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        n_tiles, split, _ = _plan(n, k, cfg, num_sms)
        results.append(
            {
                "config": vars(cfg) | {"resolved_split": split, "grid": [n_tiles, split]},
                "us": t * 1e6,
                "bw_frac": nbytes / t / bw,
                "max_abs_err": err,
            }
        )
    results.sort(key=lambda r: r["us"])
    default = DenseGemvConfig()
    row["triton_default"] = next(
        (r for r in results if r["config"]["block_n"] == default.block_n
         and r["config"]["block_k"] == default.block_k and r["config"]["split_k"] == 0
         and r["config"]["num_warps"] == default.num_warps),
        None,
    )  # fmt: skip
    row["triton_best"] = results[0] if results else None
    row["triton_all"] = results
    best = row["triton_best"]
    dflt = row["triton_default"]
    print(
        f"{name:12s} N={n:6d} K={k:6d}  cuBLAS {row['cublas_us']:7.1f} us "
        f"({row['cublas_bw_frac'] * 100:4.0f}%)  Triton default "
        f"{dflt['us'] if dflt else float('nan'):7.1f} us  best {best['us']:7.1f} us "
        f"({best['bw_frac'] * 100:4.0f}%) {best['config']}",
        flush=True,
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    ns = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    num_sms = platform.num_sms(0)
    rows = []
    for name in ns.shapes.split(","):
        rows.append(bench_shape(name, bw, num_sms))
        torch.cuda.empty_cache()
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": bw,
        "rows": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(res, indent=2))
    print("wrote", ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plot the M = 9-512 W4A16 paths of session 6 against bf16: µs per call against M for each
Qwen2.5-7B layer shape, from `bench_w4a16_mma.py --shared-only` and `--gemm-only` results.

    python benchmarks/quant/plot_w4a16_large_m.py \
        benchmarks/results/h200_session6/run2/w4a16_shared_h200.json \
        benchmarks/results/h200_session6/run4/w4a16_mma_gemm_h200.json \
        --out benchmarks/results/h200_session6/w4a16_large_m_h200.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def collect(paths: list[str]) -> tuple[str, dict]:
    """{layer: {series: {m: µs}}} over every file (a later file's value for the same point
    wins; bf16 and dequant + cuBLAS appear in both benches)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    gpu = ""
    for p in paths:
        data = json.loads(Path(p).read_text())
        gpu = data.get("gpu", gpu)
        for r in data["rows"]:
            s, m = out[r["layer"]], r["m"]
            s["bf16 cuBLAS"][m] = r["bf16_cublas_us"]
            s["W4A16 dequant + cuBLAS"][m] = r["mma_dequant_cublas_us"]
            if r.get("per_block_us"):
                s["W4A16 GEMV, per-block dequant (session 5)"][m] = r["per_block_us"]
            if r.get("shared_best"):
                s["W4A16 GEMV, shared dequant (best config)"][m] = r["shared_best"]["us"]
            if r.get("gemm_best"):
                s["W4A16 MMA-layout GEMM (best config)"][m] = r["gemm_best"]["us"]
    return gpu, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu, data = collect(args.json)
    layers = list(data)
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.8))
    for ax, layer in zip(axes, layers):
        for label, points in data[layer].items():
            ms = sorted(points)
            ax.plot(ms, [points[m] for m in ms], marker="o", label=label)
        ax.set_title(layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("µs per call")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"W4A16 g128 at M = 9-512, Qwen2.5-7B shapes, {gpu} (CUDA graph, HBM reads)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plot `bench_w4a16_mma.py` results: µs per call against M for each Qwen2.5-7B layer shape.

    python benchmarks/quant/plot_w4a16_mma.py benchmarks/results/h200_session5/run10/\
w4a16_mma_small_h200.json --out benchmarks/results/h200_session5/w4a16_mma_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.json).read_text())
    layers = list(dict.fromkeys(r["layer"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.8))
    series = {
        "bf16 cuBLAS": lambda r: r["bf16_cublas_us"],
        "W4A16 before (FMA GEMV / best of GEMM, dequant+cuBLAS)": lambda r: (
            r.get("fma_gemv_us") or min(r["triton_gemm_us"], r["old_dequant_cublas_us"])
        ),
        "W4A16 MMA GEMV (default config)": lambda r: r.get("mma_default_us"),
        "W4A16 MMA dequant + cuBLAS": lambda r: r["mma_dequant_cublas_us"],
    }
    for ax, layer in zip(axes, layers):
        rows = sorted((r for r in data["rows"] if r["layer"] == layer), key=lambda r: r["m"])
        ms = [r["m"] for r in rows]
        for label, get in series.items():
            pts = [(m, get(r)) for m, r in zip(ms, rows) if get(r)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        r0 = rows[0]
        ax.set_title(f"{layer} {r0['k']}→{r0['n']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("µs per call")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(
        f"W4A16 g128 linear layers, Qwen2.5-7B shapes, {data['gpu']} (CUDA graph, HBM reads)"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plot `bench_w4a16_tc.py` results per kernel: for each M, bf16 cuBLAS time over each W4A16
kernel's time, summed over a decoder layer's four linears (a kernel counts at an M only where it
ran on all four), symmetric weights.

    python benchmarks/quant/plot_w4a16_kernels.py RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KERNELS = {  # result key -> legend
    "gemv_us": "tensor-core GEMV (registry, M <= 64)",
    "tc_best_us": "tl.dot GEMM (registry)",
    "wgmma_best_us": "wgmma GEMM on its own layout (session 10, best config)",
    "mwg_best_us": "wgmma GEMM on the MMA layout (best config)",
    "dequant+cublas_us": "dequant + cuBLAS (registry)",
    "w4_best_us": "best W4A16",
}


def main() -> int:
    with open(sys.argv[1]) as f:
        rows = [r for r in json.load(f)["rows"] if not r["zp"]]
    sums = defaultdict(lambda: defaultdict(dict))  # model -> key -> m -> [time, layers]
    for r in rows:
        for key in ("bf16_us", *KERNELS):
            if r.get(key):
                cell = sums[r["model"]][key].setdefault(r["m"], [0.0, 0])
                cell[0] += r[key]
                cell[1] += 1
    models = sorted(sums)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        bf16 = sums[model]["bf16_us"]
        for key, label in KERNELS.items():
            ms = sorted(m for m, (_, n) in sums[model][key].items() if n == 4 and m in bf16)
            ratio = [bf16[m][0] / sums[model][key][m][0] for m in ms]
            style = {"color": "black", "lw": 2} if key == "w4_best_us" else {}
            ax.plot(ms, ratio, marker=".", label=label, **style)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens in the batch)")
        ax.set_ylabel("bf16 time / W4A16 time, layer sum")
        ax.set_title(f"Qwen2.5-{model.upper()} linears, H200 (>1: W4A16 faster)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

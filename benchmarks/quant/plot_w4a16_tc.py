"""Plot `bench_w4a16_tc.py` results: W4A16 (best kernel per M) against bf16 cuBLAS, per layer
and for the sum of a decoder layer's four linears, symmetric and with zero points.

    python benchmarks/quant/plot_w4a16_tc.py RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    with open(sys.argv[1]) as f:
        rows = json.load(f)["rows"]
    by = defaultdict(dict)  # (model, zp) -> m -> layer -> (bf16, w4)
    for r in rows:
        if r.get("w4_best_us"):
            by[(r["model"], r["zp"])].setdefault(r["m"], {})[r["layer"]] = (
                r["bf16_us"],
                r["w4_best_us"],
            )
    models = sorted({m for m, _ in by})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for zp, style in ((False, "-"), (True, "--")):
            per_m = by.get((model, zp), {})
            ms = sorted(m for m, layers in per_m.items() if len(layers) == 4)
            if not ms:  # e.g. a symmetric-only run: no empty zero-point lines in the legend
                continue
            for layer in ("qkv", "o", "gate_up", "down"):
                ax.plot(ms, [per_m[m][layer][0] / per_m[m][layer][1] for m in ms], style,
                        marker=".", label=f"{layer}{' zp' if zp else ''}")  # fmt: skip
            total = [sum(v[0] for v in per_m[m].values()) / sum(v[1] for v in per_m[m].values())
                     for m in ms]  # fmt: skip
            ax.plot(ms, total, style, color="black", lw=2, label=f"layer sum{' zp' if zp else ''}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens in the batch)")
        ax.set_ylabel("bf16 time / W4A16 time")
        ax.set_title(f"Qwen2.5-{model.upper()} linears, H200 (>1: W4A16 faster)", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""W4A16 / bf16 decode speed by batch size, from `pagoda compare` reports, one panel a device.

Reads each `report.json` (bf16 the reference configuration, W4A16 the other), prints the
tok/s and the same-run ratio per batch size and for the 256-request throughput protocol, and
draws the ratios; devices are never mixed in one ratio.

    python benchmarks/plot_w4a16_vs_bf16.py \\
        --h200 benchmarks/results/h200-2026-12-05-compare-w4a16-bf16 \\
        --h100 benchmarks/results/h100-2026-12-05-compare-w4a16-bf16 \\
        --out benchmarks/results/plots/w4a16_vs_bf16_by_batch.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = (
    "decode_tok_s@1",
    "decode_tok_s@8",
    "decode_tok_s@64",
    "decode_tok_s@128",
    "throughput_tok_s",
)
TICKS = ("1", "8", "64", "128", "256 req")


def ratios(report: Path) -> tuple[str, dict[str, tuple[float, float]]]:
    """(model label, {metric: (bf16 tok/s, W4A16 tok/s)}) of one compare report."""
    d = json.loads(report.read_text())
    ref = next(c for c in d["configs"] if c["label"] == d["reference"])
    other = next(c for c in d["configs"] if c["label"] != d["reference"])
    model = ref["label"].rsplit(" ", 1)[0]
    return model, {k: (ref["values"][k], other["values"][k]) for k in KEYS}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--h200", type=Path, required=True, help="folder holding compare_*/report.json")
    p.add_argument("--h100", type=Path, required=True, help="folder holding compare_*/report.json")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, (device, folder) in zip(axes, (("H200", ns.h200), ("H100", ns.h100)), strict=True):
        for report in sorted(folder.glob("compare_*/report.json")):
            model, vals = ratios(report)
            r = [w / b for b, w in vals.values()]
            print(
                f"{device} {model}: "
                + ", ".join(
                    f"{t} {b:,.0f} -> {w:,.0f} ({w / b:.2f}x)"
                    for t, (b, w) in zip(TICKS, vals.values(), strict=True)
                )
            )
            ax.plot(range(len(KEYS)), r, marker="o", label=f"{model} W4A16 / bf16")
            for i, v in enumerate(r):
                ax.annotate(
                    f"{v:.2f}",
                    (i, v),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=7,
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(KEYS)), TICKS)
        ax.set_xlabel("decode batch size (or the 256-request protocol)")
        ax.set_title(f"{device}, same-run ratio", fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("W4A16 tok/s ÷ bf16 tok/s")
    fig.tight_layout()
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(ns.out, dpi=130)
    print("wrote", ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

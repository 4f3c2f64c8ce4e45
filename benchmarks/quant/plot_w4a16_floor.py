"""Where the W4A16 batch-1 decode step goes, against the 2.5x-bf16 target (issue 4).

Reads the H200 results of 2026-11-30: the decode-graph ablations (`benchmarks/ablate_decode.py`,
`ablation/`), the read floor of each layer's int4 bytes (`bench_w4a16_mma.py --stream-only`,
`stream/`) and the bf16 latency measured with it; draws the step as stacked bars (now, with
every GEMV at the read floor, bf16) with the target line, and prints the numbers.

    python benchmarks/quant/plot_w4a16_floor.py \
        --out benchmarks/results/plots/w4a16_step_floor_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LAYERS = 28  # Qwen2.5-7B


def load(results: Path) -> dict:
    ab_w = json.loads((results / "ablation/ablate_w4a16.json").read_text())
    ab_b = json.loads((results / "ablation/ablate_bf16.json").read_text())
    stream = json.loads((results / "stream/w4a16_stream_floor_h200.json").read_text())
    bf16 = json.loads((results / "stream/lat_bf16.json").read_text())["pagoda"]
    g = ab_w["graph_s"]
    gemv_chain = g["norm+silu+attn"]
    floor = sum(r["best"]["us"] for r in stream["rows"]) * LAYERS / 1e6
    return {
        "graph": g["none"],
        "gemv_chain": gemv_chain,
        "other": g["none"] - gemv_chain,
        "attn": g["none"] - g["attn"],
        "norm_act": g["none"] - g["norm+silu"],
        "logits": ab_w["logits_argmax_s"],
        "gemv_read_floor": floor,
        "floor_per_layer_us": {r["layer"]: r["best"]["us"] for r in stream["rows"]},
        "bf16_graph": ab_b["graph_s"]["none"],
        "bf16_gemv_chain": ab_b["graph_s"]["norm+silu+attn"],
        "bf16_logits": ab_b["logits_argmax_s"],
        "bf16_step": bf16["decode_step_s"],
        "bf16_tok_s": bf16["decode_tok_s"],
        "target_step": bf16["decode_step_s"] / 2.5,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="benchmarks/results/h200-2026-11-30-w4a16-read-floor")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    results = Path(ns.results)
    d = load(results)
    us = {k: v * 1e6 for k, v in d.items() if isinstance(v, float) and k != "bf16_tok_s"}
    for k, v in us.items():
        print(f"{k:18s} {v:8.1f} us")
    print("read floor per layer (us):", d["floor_per_layer_us"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        ("W4A16 now", us["gemv_chain"], us["other"], us["logits"]),
        ("W4A16, every GEMV\nat the read floor", us["gemv_read_floor"], us["other"], us["logits"]),
        (
            "bf16",
            us["bf16_gemv_chain"],
            us["bf16_graph"] - us["bf16_gemv_chain"],
            us["bf16_logits"],
        ),
    ]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    colors = ("#4878d0", "#ee854a", "#8c8c8c")
    labels = (
        "linear layers (GEMVs + embedding)",
        "attention, norms, activation",
        "lm_head (bf16) + argmax",
    )
    for i, (_name, *parts) in enumerate(bars):
        left = 0.0
        for j, w in enumerate(parts):
            ax.barh(i, w, left=left, color=colors[j], label=labels[j] if i == 0 else None)
            if w > 120:
                ax.text(left + w / 2, i, f"{w:.0f}", ha="center", va="center", fontsize=8)
            left += w
        ax.text(left + 30, i, f"{left:.0f} µs", va="center", fontsize=9)
    ax.axvline(us["target_step"], color="crimson", ls="--")
    ax.text(
        us["target_step"] + 30,
        -0.55,
        f"2.5× bf16 = {us['target_step']:.0f} µs/step",
        color="crimson",
        fontsize=9,
        va="center",
    )
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.set_xlabel("µs per decode step (CUDA graph replayed alone + lm_head)")
    ax.set_title("Qwen2.5-7B batch-1 decode on one H200 (2026-11-30, dummy weights)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(0, us["bf16_graph"] + us["bf16_logits"] + 500)
    ax.set_ylim(2.6, -0.8)
    fig.tight_layout()
    out = Path(ns.out) if ns.out else Path("benchmarks/results/plots/w4a16_step_floor_h200.png")
    fig.savefig(out, dpi=130)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

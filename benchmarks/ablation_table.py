"""The decode-graph ablations of `ablate_decode.py` as a markdown table (and a bar chart).

Each JSON holds every capture of the decode graph (batch 1, or `--batch` B) in order
(`graph_runs`, some ablations captured more than once to show the capture-to-capture spread)
and the step's LM head + argmax. The table gives, per ablation, the median graph time, its
spread, the step (graph + logits) in tok/s (B tokens a step) and the difference to the real
graph ('none') per decoder layer; with a weights byte count (`--weights-gb`, what a step reads)
and the copy bandwidth (`--copy-tbs`, measured in the same run) it adds the fraction of the copy
bandwidth (acceptance 3's MBU).

    python benchmarks/ablation_table.py RUN/ablate_ab_3b_w4a16.json [...] [--layers 36]
        [--weights-gb 6.19 --copy-tbs 4.2] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def rows(result: dict, layers: int, weights_gb: float | None, copy_tbs: float | None) -> list:
    runs: dict[str, list[float]] = {}
    # every capture in order; results before session 17 hold one time per ablation
    captures = result.get("graph_runs") or list(result["graph_s"].items())
    for name, seconds in captures:
        runs.setdefault(name, []).append(seconds)
    if "none" not in runs:
        raise ValueError("no 'none' capture (the real graph) to compare with")
    base = statistics.median(runs["none"])
    logits = result.get("logits_argmax_s", 0.0)
    out = []
    for name, times in runs.items():
        t = statistics.median(times)
        step = t + logits
        row = {
            "ablation": name,
            "captures": len(times),
            "graph_us": t * 1e6,
            "spread_us": (max(times) - min(times)) * 1e6,
            "step_tok_s": result.get("batch", 1) / step,  # every sequence's token a step
            "vs_none_per_layer_us": (t - base) * 1e6 / layers,
        }
        if weights_gb and copy_tbs:
            row["mbu"] = weights_gb * 1e9 / step / (copy_tbs * 1e12)
        out.append(row)
    return out


def markdown(title: str, table: list[dict]) -> str:
    mbu = "mbu" in table[0]
    head = "| ablation | captures | graph µs (spread) | step tok/s | vs 'none' µs/layer |"
    head += " MBU |" if mbu else ""
    lines = [f"**{title}**", "", head, "|" + "---|" * (6 if mbu else 5)]
    for r in table:
        line = (
            f"| {r['ablation']} | {r['captures']} | {r['graph_us']:,.1f} ({r['spread_us']:.1f})"
            f" | {r['step_tok_s']:,.1f} | {r['vs_none_per_layer_us']:+.2f} |"
        )
        lines.append(line + (f" {100 * r['mbu']:.1f} % |" if mbu else ""))
    return "\n".join(lines)


def plot(tables: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), squeeze=False)
    for ax, (title, table) in zip(axes[0], tables.items(), strict=True):
        names = [r["ablation"] for r in table]
        values = [r["vs_none_per_layer_us"] for r in table]
        ax.barh(names, values, color=["tab:red" if v > 0 else "tab:green" for v in values])
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xlabel("graph time vs the real graph, µs per decoder layer")
        ax.set_title(title, fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: by name)")
    p.add_argument("--weights-gb", type=float, default=None)
    p.add_argument("--copy-tbs", type=float, default=None)
    p.add_argument("--plot", type=Path, default=None)
    ns = p.parse_args()
    if (ns.weights_gb is None) != (ns.copy_tbs is None):
        p.error("--weights-gb and --copy-tbs go together")
    tables = {}
    for path in ns.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"{path}: {e}")
        layers = ns.layers or (28 if "7b" in path.name.lower() else 36)
        try:
            if not isinstance(result, dict):
                raise ValueError("not a JSON object")
            table = rows(result, layers, ns.weights_gb, ns.copy_tbs)
        except (KeyError, TypeError, ValueError) as e:
            p.error(f"{path}: not an ablate_decode.py result ({e})")
        title = (
            f"{path.name}: {result.get('model', '?')}, {layers} layers, {result.get('gpu', '?')}"
        )
        tables[title] = table
        print(markdown(title, table) + "\n")
    if ns.plot:
        plot(tables, ns.plot)
        print(f"wrote {ns.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Derived end-to-end speed-up of n-gram speculation from GPU step costs and CPU acceptance.

Per kind of prompt (acceptance_cpu.py on real weights: verify steps with their accepted counts,
steps that found no draft) and per model / batch (bench_verify_cost.py on the GPU): a step with
drafts costs the verify forward replayed from a graph of query length 1 + k plus the engine's
per-step overhead measured at k = 0 (engine step - graph forward); a step without drafts costs
a plain decode step. Speed-up = plain time per token / speculative time per token. Assumes the
acceptance of the 135M model on these prompts; a larger target accepts at least as often.

With `--draft-cost` (bench_verify_cost.py --draft-models: a speculating step with a draft
model against a plain step, GPU) and `--pair` (acceptance.py on a real draft / target pair,
CPU): speed-up = tokens a decode step of the pair x plain step / speculating step, per kind.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--acceptance")
    p.add_argument("--verify", nargs="+", default=[])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-cost", help="draft_cost.json of bench_verify_cost.py")
    p.add_argument("--pair", help="acceptance.py JSON of a real draft / target pair")
    ns = p.parse_args()
    if ns.draft_cost and ns.pair:
        draft_table(
            json.loads(Path(ns.draft_cost).read_text()), json.loads(Path(ns.pair).read_text())
        )
    if not ns.acceptance:
        return
    acc = json.loads(Path(ns.acceptance).read_text())["acceptance"]
    k = str(ns.k)
    print(f"| model | batch | {' | '.join(acc)} |")
    print("|---|---:|" + "---:|" * len(acc))
    for path in ns.verify:
        d = json.loads(Path(path).read_text())
        rows = d["rows"]
        for b in sorted({r["batch"] for r in rows}):
            by_k = {r["k"]: r for r in rows if r["batch"] == b}
            if ns.k not in by_k or by_k[ns.k].get("graph_forward_s") is None:
                continue
            t0 = by_k[0]["engine_step_s"]
            overhead = t0 - by_k[0]["graph_forward_s"]
            tv = by_k[ns.k]["graph_forward_s"] + overhead
            cells = []
            for kind in acc.values():
                tps = kind["by_k"][k]["tokens_per_step"]
                verify = kind["verify_steps"]
                plain = kind["steps_without_draft"]
                steps = verify + plain
                # tokens per step = tps; time per step = mix of verify and plain steps
                t_step = (verify * tv + plain * t0) / steps
                cells.append(f"{tps * t0 / t_step:.2f}×")
            name = d["model"].replace("config:benchmarks/configs/", "")
            print(f"| {name} | {b} | {' | '.join(cells)} |")


def draft_table(cost: dict, pair: dict) -> None:
    kinds = pair["methods"]["draft"]["kinds"]
    print(f"| draft | batch | step ÷ plain | {' | '.join(kinds)} |")
    print("|---|---:|---:|" + "---:|" * len(kinds))
    for r in cost["rows"]:
        ratio = r["spec_step_ratio"]
        cells = [f"{kinds[k]['tokens_per_decode_step'] / ratio:.2f}×" for k in kinds]
        name = r["draft"].replace("config:benchmarks/configs/", "")
        print(f"| {name} | {r['batch']} | {ratio:.2f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes kernel by kernel, from a torch.profiler trace
(`benchmarks/profile_decode.py` writes `trace.json`).

With PDL the kernels of a step overlap, so a kernel's own duration says little; what each one
adds to the step is the distance between its end and the previous kernel's end (its
"increment"). The trace is cut into steps after each LM-head kernel (name prefix and grid),
and the median increment of every kernel position over the steps of the most common length is
printed for the last layers.

    python benchmarks/trace_step.py DIR/trace.json --step-end "_gemv_kernel:[18992, 1, 1]"
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--step-end", required=True, help="NAME_PREFIX:GRID of a step's last kernel")
    ap.add_argument("--last", type=int, default=40, help="kernel positions to print")
    args = ap.parse_args()
    prefix, grid = args.step_end.split(":", 1)
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps, cur = [], []
    for e in kernels:
        cur.append(e)
        if e["name"].startswith(prefix) and str(e["args"].get("grid")) == grid:
            steps.append(cur)
            cur = []
    lengths = collections.Counter(len(s) for s in steps)
    if not lengths:
        raise SystemExit(f"no kernel named {prefix}* with grid {grid} in {args.trace}")
    n = lengths.most_common(1)[0][0]
    good = [s for s in steps if len(s) == n]
    ends = [[e["ts"] + e["dur"] for e in s] for s in good]
    spans = [s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"] for s in good]
    print(f"{len(good)} steps of {n} kernels; median span {statistics.median(spans):.1f} us")
    for i in range(max(1, n - args.last), n):
        inc = statistics.median(end[i] - end[i - 1] for end in ends)
        e = good[0][i]
        print(f"{i:4d} {e['name'][:40]:40s} grid {str(e['args'].get('grid')):14s} {inc:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""First vs later start of the README's main command (`pagoda chat --message ...`).

Runs the command `--runs` times in fresh processes against an empty cache directory
(`XDG_CACHE_HOME` pointed at a new temporary folder): the first run converts the embedded GGUF
and fills the cache, the later ones read it. Writes the wall times, the load averages and the
first / median-later ratios as JSON into `--out`: of the whole command, and of the engine
start-up it prints ("ready in X s": the model's config, tokenizer and weights, the KV cache),
which is the part the cache shortens (the rest is Python, torch and transformers imports).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the JSON result")
    p.add_argument("--runs", type=int, default=3, help="starts in all (the first fills the cache)")
    p.add_argument("--message", default="What is the capital of France?")
    ns = p.parse_args()
    if ns.runs < 2:
        raise SystemExit("error: --runs must be >= 2 (a first and a later start)")
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "chat", "--message", ns.message]
    runs = []
    with tempfile.TemporaryDirectory(prefix="pagoda-cache-") as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        for i in range(ns.runs):
            load = os.getloadavg()[0]
            t = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            ready = re.search(r"ready in ([0-9.]+) s", done.stderr)
            runs.append({"run": i + 1, "wall_s": wall, "load_avg_1m": load,
                         "engine_ready_s": float(ready.group(1)) if ready else None,
                         "answer": done.stdout.strip()})  # fmt: skip
            print(f"run {i + 1}: {wall:.1f} s, engine ready in "
                  f"{runs[-1]['engine_ready_s']} s (load {load:.1f})", file=sys.stderr)  # fmt: skip
    later = statistics.median(r["wall_s"] for r in runs[1:])
    result = {
        "benchmark": "startup_cache",
        "command": " ".join(cmd[2:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": runs,
        "first_s": runs[0]["wall_s"],
        "later_median_s": later,
        "speedup": runs[0]["wall_s"] / later,
    }
    readies = [r["engine_ready_s"] for r in runs]
    if all(readies):
        result["engine_ready_first_s"] = readies[0]
        result["engine_ready_later_median_s"] = statistics.median(readies[1:])
        result["engine_ready_speedup"] = readies[0] / result["engine_ready_later_median_s"]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"startup_cache-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    engine = result.get("engine_ready_speedup", 0.0)
    print(f"command: first {result['first_s']:.1f} s, later {later:.1f} s: "
          f"{result['speedup']:.1f}x; engine start-up: {engine:.1f}x; wrote {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

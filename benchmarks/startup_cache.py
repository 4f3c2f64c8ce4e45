"""First vs second start of the README's main command (`pagoda chat --message ...`).

Each round points `XDG_CACHE_HOME` at a new empty folder and runs the whole command twice, each
time in a fresh process: the first start converts the embedded GGUF and fills the cache, the
second reads it. Wall times of the whole command (interpreter start to exit) are what count;
the engine's own "ready in X s" and the process's CPU time (user + system) are recorded beside
them. The answers of both starts must be equal (greedy decoding). Writes per-run figures, load
averages, medians, spreads and the ratio of the medians (plus each round's own ratio) as JSON
into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def _start(cmd: list[str], cache: str) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"error: the command exited with {done.returncode}")
    ready = re.search(r"ready in ([0-9.]+) s", done.stderr)
    return {"wall_s": wall, "cpu_s": cpu, "load_avg_1m": load,
            "engine_ready_s": float(ready.group(1)) if ready else None,
            "answer": done.stdout.strip()}  # fmt: skip


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the JSON result")
    p.add_argument("--rounds", type=int, default=3, help="cold-cache rounds (first + second)")
    p.add_argument("--message", default="What is the capital of France?")
    ns = p.parse_args()
    if ns.rounds < 1:
        raise SystemExit("error: --rounds must be >= 1")
    cmd = [sys.executable, "-m", "pagoda.cli", "chat", "--message", ns.message]
    rounds = []
    for i in range(ns.rounds):
        with tempfile.TemporaryDirectory(prefix="pagoda-cache-") as cache:
            first = _start(cmd, cache)
            second = _start(cmd, cache)
        if first["answer"] != second["answer"]:
            raise SystemExit(f"error: answers differ: {first['answer']!r} / {second['answer']!r}")
        rounds.append({"round": i + 1, "first": first, "second": second,
                       "ratio": first["wall_s"] / second["wall_s"]})  # fmt: skip
        print(f"round {i + 1}: first {first['wall_s']:.1f} s (ready {first['engine_ready_s']} s, "
              f"load {first['load_avg_1m']:.1f}), second {second['wall_s']:.1f} s (ready "
              f"{second['engine_ready_s']} s, load {second['load_avg_1m']:.1f}): "
              f"{rounds[-1]['ratio']:.1f}x", file=sys.stderr)  # fmt: skip
    firsts = [r["first"]["wall_s"] for r in rounds]
    seconds = [r["second"]["wall_s"] for r in rounds]
    result = {
        "benchmark": "startup_cache",
        "command": " ".join(cmd[2:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "rounds": rounds,
        "first_s": _stats(firsts),
        "second_s": _stats(seconds),
        "speedup": statistics.median(firsts) / statistics.median(seconds),
        "speedup_per_round": _stats([r["ratio"] for r in rounds]),
    }
    readies = [(r["first"]["engine_ready_s"], r["second"]["engine_ready_s"]) for r in rounds]
    if all(a and b for a, b in readies):
        result["engine_ready_first_s"] = _stats([a for a, _ in readies])
        result["engine_ready_second_s"] = _stats([b for _, b in readies])
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"startup_cache-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    f, s = result["first_s"], result["second_s"]
    print(f"whole command, median of {ns.rounds}: first {f['median']:.1f} s "
          f"[{f['min']:.1f}-{f['max']:.1f}], second {s['median']:.1f} s "
          f"[{s['min']:.1f}-{s['max']:.1f}]: {result['speedup']:.1f}x; wrote {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

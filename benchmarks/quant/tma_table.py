"""Write `pagoda/kernels/wna16/tuned/w4a16_tma.json` from a `bench_w4a16_tc.py --sweep tma` run: for
every swept (layer shape, M), the fastest TMA GEMM config where it beats the heuristic
(`default_tma_config`, the run's `tma` column) by at least `--min-gain`, else no entry config
(the heuristic). Each entry holds M from the shape's previous swept M + 1 (the first: half its
M + 1) to its own M (`gluon_wgmma_tma.tuned_tma_config`); outside every band the heuristic runs.

Configs are written as the kernel takes them now, (BLOCK_M, warpgroups, split, stages[, slabs]).
Sweeps measured before 2026-12-05 also carried x's K order as a fifth element (1 natural, 0 the
layout's slot order, since deleted): `current_config` drops it, and skips slot-order configs.

`--verify RUN`: a later `bench_w4a16_tc.py` run with the table in place (its `tma` column the
table's config, `tma_heur` the heuristic, at and between the swept M, with and without zero
points): an entry whose config is slower than the heuristic at any M of its band there is
dropped (the heuristic).

    python benchmarks/quant/tma_table.py \
        benchmarks/results/h200-2026-12-05-w4a16-tma-sweep/tma_sweep/w4a16_tc.json \
        --verify benchmarks/results/h200-2026-12-05-w4a16-tma-verify/tuned/w4a16_tc.json

`--merge TABLE`: a sweep of some layers only (e.g. qkv and o at 64-256 rows) replaces
TABLE's entries of the same (N, K, M) and keeps the others.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "pagoda" / "kernels" / "wna16" / "tuned" / "w4a16_tma.json"
CFG = re.compile(r"^tma(\[[0-9, ]+\])_us$")


def current_config(key: list[int]) -> list[int] | None:
    """A sweep key in today's config form, None for a deleted variant. Six elements: (..., K
    order, slabs), the order dropped (slot order, 0: None); five with a last 0: slot order
    (None); otherwise today's form (a fifth element is `slabs`, 1 or 2). The older sweeps' only
    five-element keys are slot order (`tma[64, 1, 3, 4, 0]`)."""
    if len(key) == 6:
        return key[:4] + key[5:] if key[4] else None
    if len(key) == 5 and key[4] == 0:
        return None
    return key


def best_entries(rows: list[dict], min_gain: float, group_size: int) -> list[dict]:
    """One entry per swept (n, k, m) of symmetric rows: the winning config or None."""
    out = []
    last: dict[tuple[int, int], int] = {}
    for r in sorted(rows, key=lambda r: (r["n"], r["k"], r["m"])):
        if r.get("zp") or "tma_us" not in r:
            continue
        swept = {}
        for name, v in r.items():
            if (m := CFG.match(name)) and (c := current_config(json.loads(m.group(1)))):
                swept[json.dumps(c)] = min(v, swept.get(json.dumps(c), v))
        if not swept:
            continue  # M not swept: no band edge here
        cfg, us = min(swept.items(), key=lambda kv: kv[1])
        heur = r.get("tma_heur_us", r["tma_us"])  # the heuristic, where a table overrode it
        gain = 1 - us / heur
        key = (r["n"], r["k"])
        min_m = last.get(key, r["m"] // 2) + 1
        last[key] = r["m"]
        entry = {"n": r["n"], "k": r["k"], "min_m": min_m, "m": r["m"], "group_size": group_size}
        entry.update(
            config=json.loads(cfg) if gain >= min_gain else None,
            us=round(us if gain >= min_gain else heur, 2),
            heuristic_us=round(heur, 2),
            layer=f"{r['model']} {r['layer']}",
        )
        out.append(entry)
    return sorted(out, key=lambda e: (e["n"], e["k"], e["m"]))


def verify(entries: list[dict], rows: list[dict]) -> int:
    """Drop (to the heuristic) each config measured slower than the heuristic at any M of its
    band in `rows`; the number dropped."""
    dropped = 0
    for e in entries:
        if not e["config"]:
            continue
        slower = [
            f"M={r['m']} zp={int(r['zp'])}: {r['tma_us']:.1f} vs {r['tma_heur_us']:.1f} µs"
            for r in rows
            if (r["n"], r["k"]) == (e["n"], e["k"]) and e["min_m"] <= r["m"] <= e["m"]
            and "tma_heur_us" in r and r["tma_us"] > r["tma_heur_us"]
        ]  # fmt: skip
        if slower:
            e.update(config=None, us=e["heuristic_us"], dropped=f"slower in --verify: {slower}")
            dropped += 1
    return dropped


def merge(old: list[dict], new: list[dict]) -> tuple[list[dict], int]:
    """`new`'s entries, and `old`'s of every (N, K, M) that `new` has none of; how many of
    `old`'s were kept."""
    swept = {(e["n"], e["k"], e["m"]) for e in new}
    kept = [e for e in old if (e["n"], e["k"], e["m"]) not in swept]
    return sorted(kept + new, key=lambda e: (e["n"], e["k"], e["m"])), len(kept)


def _load(path: str, key: str, what: str) -> dict:
    """A JSON object with a list under `key`, or exit naming what is wrong with the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise SystemExit(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise SystemExit(f"{path}: no '{key}' list: not {what}")
    return data


def _read(path: str) -> dict:
    """A bench_w4a16_tc.py result, or exit naming what is wrong with the file."""
    return _load(path, "rows", "a bench_w4a16_tc.py result")


def _read_table(path: str, gpu: str) -> dict:
    """A table this script wrote, for the sweep's GPU, or exit naming what is wrong."""
    table = _load(path, "entries", "a tuned TMA table")
    if table.get("gpu") != gpu:
        raise SystemExit(f"{path}: a table for {table.get('gpu')!r}, the sweep ran on {gpu!r}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep", help="w4a16_tc.json of a --sweep tma run")
    ap.add_argument("--min-gain", type=float, default=0.05, help="fraction faster (0.05: 5 %%)")
    ap.add_argument("--group-size", type=int, default=128, help="the run's group size")
    ap.add_argument("--verify", default=None, help="a later run with the table (see above)")
    ap.add_argument("--merge", default=None, help="an existing table to update (see above)")
    ap.add_argument("--out", default=str(TABLE))
    args = ap.parse_args()
    data = _read(args.sweep)
    gpu = data.get("env", {}).get("gpu") or data.get("env", {}).get("device")
    if not gpu:
        raise SystemExit(f"{args.sweep}: no GPU name in its env block")
    entries = best_entries(data["rows"], args.min_gain, args.group_size)
    source = f"{Path(args.sweep).resolve().relative_to(ROOT)}"
    if args.verify:
        rows = _read(args.verify)["rows"]
        print(f"--verify: {verify(entries, rows)} config(s) dropped")
        source += f", verified by {Path(args.verify).resolve().relative_to(ROOT)}"
    if args.merge:
        old = _read_table(args.merge, gpu)
        entries, kept = merge(old["entries"], entries)
        source = f"{old['source']}; then {source}"
        print(f"--merge: {kept} entries kept from {args.merge}")
    table = {
        "source": f"{source} (bench_w4a16_tc.py --sweep tma, "
        f"CUDA-graph timings, symmetric, group {args.group_size}; a config where >= "
        f"{args.min_gain:.0%} faster than the heuristic)",
        "gpu": gpu,
        "entries": entries,
    }
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    tuned = sum(e["config"] is not None for e in entries)
    print(f"{args.out}: {len(entries)} entries, {tuned} with a tuned config")


if __name__ == "__main__":
    main()

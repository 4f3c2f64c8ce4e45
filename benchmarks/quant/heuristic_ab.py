"""Two TMA GEMM heuristics on one sweep: for every row of a `bench_w4a16_tc.py --sweep tma` run,
the config each heuristic picks and its time in that run, side by side with the sweep's best
and bf16 (the run's own columns; both picks must be among the swept configs or the row's
default). `--old FILE`: a copy of `gluon_wgmma_tma.py` whose `default_tma_config` is the
heuristic to compare against (e.g. `git show REV:pagoda/kernels/wna16/gluon_wgmma_tma.py > old.py`).

    python benchmarks/quant/heuristic_ab.py RUN/w4a16_tc.json --old old.py [--sms 132]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def config_times(row: dict) -> dict[tuple, float]:
    """{config: µs} of a row's swept configs (`tma[...]_us` keys)."""
    out = {}
    for key, v in row.items():
        if key.startswith("tma[") and key.endswith("]_us"):
            out[tuple(json.loads(key[3:-3]))] = v
    return out


def pick_time(row: dict, config: tuple, new_default: tuple) -> float | None:
    """The run's time of `config`: a swept key, or the row's default column where `config` is
    the default the run itself used (`tma_heur` where a table overrode it, else `tma`)."""
    times = config_times(row)
    if config in times:
        return times[config]
    if config == new_default:
        return row.get("tma_heur_us", row.get("tma_us"))
    return None


def load_heuristic(path: str):
    """The module at `path`, which must define `default_tma_config`, or exit saying why not."""
    if not Path(path).is_file():
        raise SystemExit(f"--old {path}: no such file")
    spec = importlib.util.spec_from_file_location("old_tk", path)
    old = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(old)
    except Exception as e:  # noqa: BLE001 - any failure to import it is the file's problem
        raise SystemExit(f"--old {path}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(getattr(old, "default_tma_config", None)):
        raise SystemExit(f"--old {path}: defines no default_tma_config")
    return old


def load_run(path: str) -> dict:
    """A `bench_w4a16_tc.py` result, or exit naming what is wrong with the file."""
    import tma_table  # this folder's table writer reads the same files

    return tma_table._read(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--old", required=True, help="a gluon_wgmma_tma.py with the other heuristic")
    ap.add_argument("--sms", type=int, default=132)
    ns = ap.parse_args()
    from pagoda.kernels.wna16 import gluon_wgmma_tma as tk

    old = load_heuristic(ns.old)
    data = load_run(ns.run)
    print(f"{data.get('env', {}).get('gpu')}: µs, new / old < 1 is faster")
    tot_new = tot_old = 0.0
    out = []
    for r in data["rows"]:
        m, n, k = r["m"], r["n"], r["k"]
        c_new = tuple(tk.default_tma_config(m, n, k, ns.sms))
        c_old = tuple(old.default_tma_config(m, n, k, ns.sms))
        t_new, t_old = pick_time(r, c_new, c_new), pick_time(r, c_old, c_new)
        times = config_times(r)
        best = min(times, key=times.get) if times else None
        line = {
            "model": r["model"], "layer": r["layer"], "m": m, "zp": r.get("zp", False),
            "bf16_us": r.get("bf16_us"), "new": list(c_new), "new_us": t_new,
            "old": list(c_old), "old_us": t_old, "best": list(best) if best else None,
            "best_us": times.get(best), "mwg_us": r.get("mwg_us"),
        }  # fmt: skip
        out.append(line)
        ratio = f"{t_new / t_old:.3f}" if t_new and t_old else "-"
        print(
            f"{r['model']} {r['layer']:8s} M={m:4d} bf16 {r.get('bf16_us', 0):6.1f}  "
            f"new {c_new} {t_new or 0:6.1f}  old {c_old} {t_old or 0:6.1f}  new/old {ratio}  "
            f"best {best} {times.get(best, 0):6.1f}"
        )
        if t_new and t_old:
            tot_new, tot_old = tot_new + t_new, tot_old + t_old
    if tot_old:
        print(f"sum over rows with both: new {tot_new:.1f} / old {tot_old:.1f} µs = "
              f"{tot_new / tot_old:.3f}")  # fmt: skip
    Path(ns.run).with_name("heuristic_ab.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

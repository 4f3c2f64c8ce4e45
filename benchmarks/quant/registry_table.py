"""Per-layer W4A16 vs bf16 as the kernel registry dispatches, from a `bench_w4a16_tc.py` run.

For each model and M, every linear of a decoder layer takes the kernel `choose_kernels` picks
on an H200 (sm_90, 132 SMs) with the config its default rule picks; the table sums the four
linears' measured times (bf16 cuBLAS is the denominator) and marks an M where the run did not
time that kernel and config ("n/m"). The TMA GEMM's config is looked up among the run's swept
ones (`tma[...]`), or its plain `tma` key where it is the rule session 15's run 2 timed.

    python benchmarks/quant/registry_table.py RUN/w4a16_tc.json [--zp 0] [--current]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.kernels.wna16 import gluon_mma_wgmma as mwg  # noqa: E402
from pagoda.kernels.wna16 import gluon_wgmma_tma as tk  # noqa: E402
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402
from pagoda.layers import wna16_kernels as wk  # noqa: E402

NUM_SMS = 132
LAYERS = ("qkv", "o", "gate_up", "down")
# The dispatch is computed here, maybe without a GPU: take the tensor-core layout's self-test
# as passed (the run whose times this reads checked every kernel against the reference).
mma.mma_self_test = lambda device_index: True


def _old_default(m: int, n: int) -> tuple:
    """The default config of session 12's first sweep (its rows' plain `mwg` key)."""
    p2 = next((b for b in mwg.BLOCK_MS if b >= m), mwg.MAX_BLOCK_M)
    block_m = min(128, p2 if p2 <= 32 else p2 // 2)
    wgs = 2 if n % 128 == 0 else 1
    programs = -(-m // block_m) * (n // (64 * wgs))
    split = max(1, min(16, round(2 * NUM_SMS / programs))) if programs < NUM_SMS else 1
    return (block_m, wgs, split, 4, False)


def _run2_tma_default(m: int, n: int, k: int) -> tuple:
    """The TMA GEMM's default rule when session 15's run 2 timed it (its rows' plain `tma`)."""
    block_m = next((b for b in tk.BLOCK_MS if b >= m), tk.BLOCK_MS[-1])
    m_tiles = -(-m // block_m)
    wgs = 2 if m_tiles * (n // tk.rows_per_cta(2)) >= NUM_SMS else 1
    ctas = m_tiles * -(-n // tk.rows_per_cta(wgs))
    split = 1
    if ctas < NUM_SMS:
        split = max(1, min(round(NUM_SMS / ctas), k // 64 // 8, 16))
    return (block_m, wgs, split, 4)


def kernel_key(row: dict, zp: bool, current: bool) -> tuple[str, str]:
    """(kernel name, the row's key of its time) for the registry's choice at this row's M;
    `current`: the run timed the default config of this code (its plain `mwg` key)."""
    n, k, m = row["n"], row["k"], row["m"]
    cfg = wk.KernelConfig("cuda", 0, (9, 0), NUM_SMS, "NVIDIA H200", n, k, 4, zp, 128,
                          torch.bfloat16)  # fmt: skip
    kernel = wk.choose_kernels(cfg, frozenset()).pick(m)
    if kernel.name == "mma_wgmma_tma":
        if current:
            return kernel.name, "tma_us"
        c = tuple(int(v) for v in tk.default_tma_config(m, n, k, NUM_SMS))
        key = f"tma{list(c)}_us"
        if key not in row and c == _run2_tma_default(m, n, k):
            key = "tma_us"
        return kernel.name, key
    if kernel.name == "mma_wgmma":
        if current:
            return kernel.name, "mwg_us"
        c = tuple(int(v) for v in mwg.default_wgmma_config(m, n, k, NUM_SMS))
        key = f"mwg{list(c)}_us"
        if key not in row and c == tuple(int(v) for v in _old_default(m, n)):
            key = "mwg_us"
        return kernel.name, key
    return kernel.name, {"mma_gemv": "gemv_us", "mma_gemm": "tc_us",
                         "mma_dequant": "dequant+cublas_us"}[kernel.name]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--zp", type=int, default=0)
    ap.add_argument(
        "--current", action="store_true",
        help="the run timed this code's default wgmma configs (else: session 12's second sweep, "
        "whose plain `mwg` rows are the first default rule)",
    )  # fmt: skip
    ap.add_argument(
        "--best-timed", action="store_true",
        help="where the run did not time the default config, take the kernel's best timed one "
        "(marked *) instead of n/m",
    )  # fmt: skip
    ns = ap.parse_args()
    rows = [r for r in json.loads(Path(ns.json).read_text())["rows"] if r["zp"] == bool(ns.zp)]
    for model in sorted({r["model"] for r in rows}):
        ms = sorted({r["m"] for r in rows if r["model"] == model})
        print(f"\n{model}: M | bf16 us | W4A16 us | bf16 / W4A16 | kernels (qkv, o, gate_up, down)")
        for m in ms:
            layer_rows = [r for r in rows if r["model"] == model and r["m"] == m]
            bf16, w4, names = 0.0, 0.0, []
            # a layer the run has no row for (a step cut at its time limit) is no sum either
            missing = [
                f"{lay}:no row" for lay in LAYERS if lay not in {r["layer"] for r in layer_rows}
            ]
            for r in layer_rows:
                name, key = kernel_key(r, bool(ns.zp), ns.current)
                bf16 += r["bf16_us"]
                names.append(name.removeprefix("mma_"))
                family = {"mma_wgmma_tma": "tma", "mma_wgmma": "mwg"}.get(name)
                if key in r:
                    w4 += r[key]
                elif ns.best_timed and family and f"{family}_best_us" in r:
                    w4 += r[f"{family}_best_us"]
                    names[-1] += "*"
                else:
                    missing.append(f"{r['layer']}:{key}")
            ratio = "n/m" if missing else f"{bf16 / w4:.2f}"
            w4s = "n/m" if missing else f"{w4:.1f}"
            print(f"{m} | {bf16:.1f} | {w4s} | {ratio} | {', '.join(names)}"
                  + (f" (not timed: {', '.join(missing)})" if missing else ""))  # fmt: skip


if __name__ == "__main__":
    main()

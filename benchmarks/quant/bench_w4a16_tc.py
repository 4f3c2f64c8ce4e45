"""W4A16 per-layer kernels at M = 1-256 against bf16 cuBLAS, Qwen2.5-7B and 3B shapes (H200).

Kernels (on the `repack_mma` tensor-core layout, the layer's only weight copy):
`gemv` (M <= 64: `wna16_mma_gemv`), `tc` (`wna16_mma_gemm`: dequantization in registers,
`tl.dot`; `--sweep` tries its configs), `mwg` (`wna16_mma_wgmma`, the Gluon wgmma GEMM, sm_90
only; `--sweep mwg` tries its configs), `tma` (`wna16_wgmma_tma`, the TMA-fed warp-specialized
wgmma GEMM, sm_90 only, its tuned table's config where it has one, else the heuristic;
`--sweep tma` tries its configs; `tma_heur`: the heuristic where the table overrides it),
`dequant+cublas`
(`wna16_mma_dequant` then `F.linear`), and `bf16` (cuBLAS on the dense weight) as the
denominator of every ratio. Each is timed inside one CUDA graph cycling over enough weight
copies to stream > 4x the L2 from HBM per replay (`pagoda.bench.common.graph_time_per_call`),
symmetric and with zero points (`--zp`). Every result is checked against the fp32 matmul of the
dequantized weight before it is timed.

    python benchmarks/quant/bench_w4a16_tc.py --out DIR [--sweep [tc,mwg]] [--models 7b,3b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.bench.common import copy_bandwidth, environment  # noqa: E402
from pagoda.bench.common import graph_time_per_call as time_graph  # noqa: E402
from pagoda.kernels.wna16 import gluon_mma_wgmma as mwg  # noqa: E402
from pagoda.kernels.wna16 import gluon_wgmma_tma as tk  # noqa: E402
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402
from pagoda.kernels.workspace import SplitKWorkspace  # noqa: E402

SHAPES = {  # model: {layer: (N, K)}
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "3b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)},
}
MS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
SWEEP_MS = (16, 32, 64, 128, 256)
GROUP = 128

WS = SplitKWorkspace()  # split-K scratch, as the model runner owns one


def tc_sweep(m: int, n: int, k: int, num_sms: int) -> list[mma.GemmMmaConfig]:
    """The default first, then swap-AB tiles of the two largest BLOCK_M up to M (cap 128) and
    plain [64 | 128, 4 | 8 | 16 CG] tiles, each with and without split-K where few programs."""
    out = [mma.default_mma_gemm_config(m, n, k, num_sms)]
    p2 = 16
    while p2 < m and p2 < 128:
        p2 *= 2
    plans = [(True, bm, 4, st) for bm in sorted({max(16, p2 // 2), p2}) for st in (3, 4)]
    plans += [(False, bm, w, 3) for bm in (64, 128) for w in (4, 8)]
    for swap, bm, warps, stages in plans:
        for cg in (4, 8, 16):
            programs = -(-m // bm) * (n // (16 * cg))
            splits = {1}
            if programs < num_sms:
                splits.add(max(1, min(8, round(num_sms / programs))))
            for split in sorted(splits):
                c = (bm, cg, 2, split, warps, stages, swap)
                if c not in out:
                    out.append(c)
    return out


def mwg_sweep(m: int, n: int, k: int, num_sms: int) -> list[mwg.WgmmaConfig]:
    """The MMA-layout wgmma GEMM's tiles: the BLOCK_M that holds M and half of it (at most
    128), two warpgroups (one where N needs it), no split-K and the split that makes about two
    programs an SM; the activations in slot order (4-stage ring) or natural K order (4 or 8)."""
    p2 = next((b for b in mwg.BLOCK_MS if b >= m), mwg.MAX_BLOCK_M)
    wgs = 2 if n % 128 == 0 else 1
    out = []
    for bm in sorted({min(128, max(8, p2 // 2)), min(128, p2)}):
        programs = -(-m // bm) * (n // (64 * wgs))
        splits = {1}
        if programs < num_sms:
            splits.add(max(1, min(16, round(2 * num_sms / programs))))
        for sp in sorted(splits):
            for st, natural in ((4, False), (4, True), (8, True)):
                if mwg.wgmma_smem_bytes(bm, wgs, st) <= mwg.SMEM_BYTES:
                    out.append((bm, wgs, sp, st, natural))
    default = tuple(mwg.default_wgmma_config(m, n, k, num_sms))
    default = default + (False,) * (5 - len(default))
    return [c for c in out if c != default]


def mwgx_sweep(m: int, n: int, k: int, num_sms: int) -> list[mwg.WgmmaConfig]:
    """The default config with the scale pairs a loop trip ahead and / or the staged epilogue,
    then, staged, split-K 1-12 at the default BLOCK_M, half of it and (past 64 rows) 128."""
    d = tuple(int(v) for v in mwg.default_wgmma_config(m, n, k, num_sms))[:5]
    out = [d + (1, 0), d + (0, 1), d + (1, 1)]
    p2 = next((b for b in mwg.BLOCK_MS if b >= m), mwg.MAX_BLOCK_M)
    bms = {d[0]} | ({p2 // 2} if p2 >= 32 else set()) | ({128} if m > 64 else set())
    for bm in sorted(bms):
        natural = int(bm > 32 or d[4])
        for split in (1, 2, 3, 4, 6, 9, 12):
            if split <= k // 64:
                c = (bm, d[1], split, 4, natural, 0, 1)
                if c not in out:
                    out.append(c)
    return out


def mwgw_sweep(m: int, n: int, k: int, num_sms: int) -> list[mwg.WgmmaConfig]:
    """The default config with one warpgroup a program (twice the programs, more of them an
    SM) at the default rule's split for that count and half of it, and with 6 / 8 stages."""
    d = tuple(int(v) for v in mwg.default_wgmma_config(m, n, k, num_sms))
    bm, wgs, split, stages, natural, ahead, staged = d
    out = []
    for st in (6, 8):
        if mwg.wgmma_smem_bytes(bm, wgs, st) <= mwg.SMEM_BYTES // 2:
            out.append((bm, wgs, split, st, natural, ahead, staged))
    programs = -(-m // bm) * (n // 64)
    s1 = max(1, min(16, round(2 * num_sms / programs))) if programs < num_sms else 1
    for sp in sorted({s1, max(1, s1 // 2)}):
        for st in (4, 6):
            c = (bm, 1, sp, st, natural, ahead, staged)
            if c != d and c not in out:
                out.append(c)
    return out


def tma_sweep(m: int, n: int, k: int, num_sms: int) -> list[tk.TmaConfig]:
    """The TMA GEMM around its default: the last wave's tiles split 1-16 ways (at least 4 K
    steps a split), half the BLOCK_M, two consumer warpgroups and a 6-stage ring at the
    default split; past 128 rows, 256-row tiles of one slab a warpgroup (half the
    dequantization per MMA); at 65-128 rows the 128-row tile on two warpgroups of one slab
    each; on layers of N < 8192 (qkv, o: latency-bound from 64 rows) CTAs of one
    warpgroup and one slab (64 weight rows: twice the CTAs) split 1-8 ways and as the default
    splits (the default may itself be one slab)."""
    d = tuple(int(v) for v in tk.default_tma_config(m, n, k, num_sms))
    bm, _, split, _ = d[:4]
    out = [(bm, 1, sp, 4) for sp in (1, 2, 3, 4, 6, 8, 12, 16) if sp <= max(1, k // 64 // 4)]
    out += [(max(tk.BLOCK_MS[0], bm // 2), 1, split, 4), (bm, 2, split, 4), (bm, 1, split, 6)]
    if m > 128 and k // 64 % 2 == 0:
        out += [(256, 2, sp, 4, 1) for sp in (1, split)]
    elif bm == 128 and k // 64 % 2 == 0:  # the same tile on two warpgroups of one slab each
        out += [(128, 2, split, 4, 1)]
    if n < 8192 and m >= 64 and k // 64 % 2 == 0:  # more, smaller CTAs on the small layers
        out += [(bm, 1, sp, 4, 1) for sp in (1, 2, 3, 4, 6, 8, split) if sp <= k // 64 // 4]
        out += [(bm, 1, split, 4)]  # the two-slab tile at the default's split
    fits = [c for c in out if tk.smem_bytes(c[0], c[1], c[3], True, *c[4:]) <= tk.SMEM_BYTES]
    return [c for c in dict.fromkeys(fits) if c != d]


class Layer:
    """`copies` random weight copies of one (N, K) layer in the MMA layout + one dense copy."""

    def __init__(self, n: int, k: int, l2: int, zp: bool, dev: torch.device) -> None:
        self.n, self.k = n, k
        packed = n * k // 2
        self.copies = max(2, -(-4 * l2 // packed))
        g = torch.Generator(device=dev).manual_seed(n * 7 + k)
        self.words = [
            torch.randint(-(2**31), 2**31 - 1, (n * k // 8,), device=dev, dtype=torch.int32,
                          generator=g)
            for _ in range(self.copies)
        ]  # fmt: skip
        groups = k // GROUP
        self.pairs = [
            mma.repack_mma_scales(
                (torch.rand(groups, n, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
            )
            for _ in range(self.copies)
        ]
        self.zeros = None
        if zp:
            self.zeros = [
                mma.repack_mma_zeros(torch.randint(0, 16, (groups, n), device=dev, generator=g))
                for _ in range(self.copies)
            ]
        self.dense_copies = max(2, -(-4 * l2 // (n * k * 2)))
        w0 = mma.wna16_mma_dequant(self.words[0], self.pairs[0], n, k, GROUP, self.z(0))
        self.w_ref = w0.float()
        self.dense = [w0] + [torch.randn_like(w0) * 0.02 for _ in range(self.dense_copies - 1)]

    def z(self, i: int):
        return self.zeros[i] if self.zeros is not None else None


def check(y: torch.Tensor, x: torch.Tensor, layer: Layer) -> float:
    ref = x.float() @ layer.w_ref.t()
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def candidates(
    x: torch.Tensor, layer: Layer, zp: bool, sweep: str, num_sms: int, skip: frozenset = frozenset()
) -> dict:
    m, n, k = x.shape[0], layer.n, layer.k
    cands = {}
    if m <= mma.MAX_ROWS:
        cands["gemv"] = lambda i: mma.wna16_mma_gemv(
            x, layer.words[i], layer.pairs[i], n, GROUP, zero_pairs=layer.z(i), workspace=WS
        )
    cands["dequant+cublas"] = lambda i: F.linear(
        x, mma.wna16_mma_dequant(layer.words[i], layer.pairs[i], n, k, GROUP, layer.z(i))
    )
    hopper = torch.cuda.get_device_capability(x.device) == (9, 0)
    swept = sweep.split(",") if m in SWEEP_MS else []
    hopper_gemms = (
        ("mwg", mwg.wna16_mma_wgmma, mwg.gluon_available(),
         {"mwg": mwg_sweep, "mwgx": mwgx_sweep, "mwgw": mwgw_sweep}),
        ("tma", tk.wna16_wgmma_tma, tk.gluon_tma_available(), {"tma": tma_sweep}),
    )  # fmt: skip
    for label, kernel, available, sweeps in hopper_gemms:
        if not (hopper and available):
            continue
        configs = [None] + [c for s_ in swept if s_ in sweeps for c in sweeps[s_](m, n, k, num_sms)]
        for c in configs:

            def gemm(i, c=c, kernel=kernel):
                return kernel(
                    x, layer.words[i], layer.pairs[i], n, GROUP, zero_pairs=layer.z(i),
                    workspace=WS, config=c,
                )  # fmt: skip

            cands[label if c is None else f"{label}{[int(v) for v in c]}"] = gemm
    if hopper and tk.gluon_tma_available():  # the heuristic, where the tuned table overrides it
        gpu = torch.cuda.get_device_name(x.device)
        if tk.tuned_tma_config(gpu, m, n, k, GROUP, num_sms, zp) is not None:
            heur = tk.default_tma_config(m, n, k, num_sms)
            cands["tma_heur"] = lambda i: tk.wna16_wgmma_tma(
                x, layer.words[i], layer.pairs[i], n, GROUP, zero_pairs=layer.z(i),
                workspace=WS, config=heur,
            )  # fmt: skip
    configs = [None]
    if "tc" in sweep.split(",") and m in SWEEP_MS and not zp:
        configs = tc_sweep(m, n, k, num_sms)
    if m >= 8:
        for c in configs:

            def fn(i, c=c):
                return mma.wna16_mma_gemm(
                    x, layer.words[i], layer.pairs[i], n, GROUP, config=c, zero_pairs=layer.z(i)
                )

            cands["tc" if c is None else f"tc{list(c)}"] = fn
    return {key: fn for key, fn in cands.items() if key.split("[")[0] not in skip}


def bench(model, name, n, k, zp: bool, sweep: str, bw, l2, num_sms, dev, ms=MS, skip=frozenset()):
    layer = Layer(n, k, l2, zp, dev)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev).bfloat16()
        row = {"model": model, "layer": name, "n": n, "k": k, "m": m, "zp": zp}
        t = time_graph(lambda i, x=x: F.linear(x, layer.dense[i]), layer.dense_copies)
        row["bf16_us"] = t * 1e6
        row["bf16_bw_frac"] = n * k * 2 / t / bw
        for key, fn in candidates(x, layer, zp, sweep, num_sms, skip).items():
            try:
                err = check(fn(0), x, layer)
                if err > 2e-2:
                    row[key + "_err"] = err
                    continue
                row[key + "_us"] = time_graph(fn, layer.copies) * 1e6
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                row[key + "_fail"] = repr(e)[:160]
        for fam in ("tc", "mwg", "tma"):
            times = {kk: v for kk, v in row.items() if kk.startswith(fam) and kk.endswith("_us")}
            if times:
                best = min(times, key=times.get)
                row[fam + "_best"] = best[:-3]
                row[fam + "_best_us"] = times[best]
        w4 = [
            v for kk, v in row.items()
            if kk.endswith("_us") and kk != "bf16_us" and not kk.endswith("_best_us")
        ]  # fmt: skip
        row["w4_best_us"] = min(w4) if w4 else None
        row["ratio_vs_bf16"] = row["bf16_us"] / row["w4_best_us"] if w4 else None
        rows.append(row)
        shown = {
            kk[:-3]: v
            for kk, v in row.items()
            if kk.endswith("_us") and kk not in ("bf16_us", "w4_best_us") and "[" not in kk
        }
        best_of = [row.get(f + "_best", "") for f in ("tc", "mwg", "tma")]
        print(
            f"{model} {name:8s} zp={int(zp)} M={m:4d} bf16 {row['bf16_us']:8.1f}  "
            + "  ".join(f"{kk} {v:7.1f}" for kk, v in shown.items())
            + f"  best x{row['ratio_vs_bf16'] or 0:.2f} ({' '.join(b for b in best_of if b)})",
            flush=True,
        )
    return rows


def main() -> None:
    global SWEEP_MS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="tc",
        default="",
        help="try these kernels' configs at the sweep's M: tc (default), mwg (the wgmma GEMM), "
        "mwgx (its scales-ahead / staged-epilogue variants and split-K), mwgw (one warpgroup "
        "a program, deeper rings), tma (the TMA GEMM's tiles, splits and rings), "
        "comma-separated; any other word (e.g. none): the default configs only",
    )
    ap.add_argument("--models", default="7b,3b")
    ap.add_argument("--zp", default="0,1", help="symmetric (0) and / or zero points (1)")
    ap.add_argument("--layers", default=None, help="only these layers, e.g. gate_up,down")
    ap.add_argument("--ms", default=None, help="only these M, e.g. 64,128,256")
    ap.add_argument(
        "--sweep-ms", default=None, help=f"sweep configs at these M (default {SWEEP_MS})"
    )
    ap.add_argument(
        "--skip", default="", help="kernels not to time, e.g. tc,gemv (bf16 is always timed)"
    )
    ns = ap.parse_args()
    skip = frozenset(v for v in ns.skip.split(",") if v)
    ms = [int(v) for v in ns.ms.split(",")] if ns.ms else MS
    if ns.sweep_ms:
        SWEEP_MS = tuple(int(v) for v in ns.sweep_ms.split(","))
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth(dev)
    t0 = time.time()
    rows = []
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in ns.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            if ns.layers and name not in ns.layers.split(","):
                continue
            for zp in (int(z) for z in ns.zp.split(",")):
                rows += bench(model, name, n, k, bool(zp), ns.sweep, bw, l2,
                              props.multi_processor_count, dev, ms, skip)  # fmt: skip
                result = {"env": environment(dev), "copy_bw": bw, "seconds": time.time() - t0}
                result["rows"] = rows  # written after every layer: a cut-off run keeps its rows
                (out / "w4a16_tc.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

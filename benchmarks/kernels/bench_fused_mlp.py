"""The batch-1 decode MLP half, unfused (the engine's four kernels) against `triton_fused_mlp`,
per layer, Qwen2.5-3B and -7B shapes, bf16 and W4A16 (group 128), with a sweep of configs.

Unfused: `fused_add_rms_norm`, the gate_up GEMV, `silu_and_mul`, the down GEMV (bf16: the dense
Triton GEMV; W4A16: the tensor-core GEMV), PDL-chained as in the decode graph. Fused: bf16 in one
launch (`fused_mlp_decode`), W4A16 as `norm_gate_up_silu_w4a16` + the down GEMV. Each call reads
its own copy of the weights (copies enough to exceed the L2 several times), all calls in one
CUDA graph (`graph_time_per_call`), so every call streams from HBM. The denominator of
`fused / unfused` is the unfused chain of the same run; `bw_frac` is the weight bytes over the
time, against the copy bandwidth measured first. `max_abs_diff`: fused against unfused output.

    python benchmarks/kernels/bench_fused_mlp.py --out benchmarks/results/fused_mlp_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {"3b": (2048, 11008), "7b": (3584, 18944)}  # (hidden, intermediate)


def dense_configs():
    from pagoda.kernels.triton_fused_mlp import FusedMlpConfig as C

    return [
        C(),
        C(block_i=16, block_k=256),
        C(block_n=4, block_k2=2048),
        C(block_n=16, block_k2=512),
        C(num_warps=8),
        C(num_stages=4),
        C(block_i=4, block_k=1024, block_n=4, block_k2=2048, num_warps=8),
    ]


def w4_configs():
    from pagoda.kernels.triton_fused_mlp import FusedW4Config as C

    return [
        C(),
        C(k_tiles=2),
        C(k_tiles=8),
        C(groups=2, k_tiles=2),
        C(num_warps=8, k_tiles=8),
        C(programs_per_sm=2),
        C(programs_per_sm=8, num_warps=2, k_tiles=2),
    ]


def _measure(fn, ref, copies: int, label: str) -> tuple[float, float] | None:
    """(seconds a call in the graph, max |fn(0) - ref|), or None (printed) where it fails."""
    from pagoda.bench.common import graph_time_per_call

    try:
        diff = float((fn(0)[0].float() - ref).abs().max())
        return graph_time_per_call(fn, copies), diff
    except Exception as e:  # noqa: BLE001 - a config that fails is reported, skipped
        print(f"  {label}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _timed(variant, cfg, t, diff, t_unfused, nbytes, bw, ref) -> dict:
    """A fused variant's row: time, bandwidth fraction, ratio to the unfused chain, error."""
    return {
        "variant": variant,
        "config": vars(cfg),
        "us": t * 1e6,
        "bw_frac": nbytes / t / bw,
        "fused_over_unfused": t / t_unfused,
        "max_abs_diff": diff,
        "ref_max_abs": float(ref.abs().max()),
    }


def _copies(nbytes: int) -> int:
    return max(3, min(32, -(-(600 << 20) // nbytes)))


def bench_dense(name: str, bw: float, configs: list, device: str = "cuda") -> list[dict]:
    from pagoda.bench.common import graph_time_per_call
    from pagoda.kernels import fused_ops
    from pagoda.kernels.triton_fused_mlp import fused_mlp_decode
    from pagoda.kernels.triton_gemv import gemv_bf16
    from pagoda.kernels.workspace import SplitKWorkspace

    h, inter = SHAPES[name]
    dev, dt = torch.device(device), torch.bfloat16
    nbytes = 3 * h * inter * 2
    copies = _copies(nbytes)
    wgu = [torch.randn(2 * inter, h, device=dev, dtype=dt) / h**0.5 for _ in range(copies)]
    wd = [torch.randn(h, inter, device=dev, dtype=dt) / inter**0.5 for _ in range(copies)]
    hid, res = (torch.randn(1, h, device=dev, dtype=dt) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(h, device=dev, dtype=dt)
    ws = SplitKWorkspace()
    act = ws.scratch(dev, inter, dt, "act")
    bar = ws.barrier(dev)

    def unfused(i):
        x, r = fused_ops.fused_add_rms_norm(hid, res, nw, 1e-6)
        a = fused_ops.silu_and_mul(gemv_bf16(x, wgu[i], workspace=ws))
        return gemv_bf16(a, wd[i], workspace=ws), r

    rows = []
    ref = unfused(0)[0].float()
    t_un = graph_time_per_call(unfused, copies)
    base = {"shape": name, "kind": "bf16", "hidden": h, "inter": inter, "copies": copies}
    rows.append(base | {"variant": "unfused", "us": t_un * 1e6, "bw_frac": nbytes / t_un / bw})
    for cfg in configs:
        for two in (False, True):

            def fused(i, cfg=cfg, two=two):
                return fused_mlp_decode(hid, res, nw, 1e-6, wgu[i], wd[i], act, bar, cfg, two)

            got = _measure(fused, ref, copies, f"{name} {cfg} two={two}")
            if got is not None:
                variant = "two_launches" if two else "one_launch"
                rows.append(base | _timed(variant, cfg, *got, t_un, nbytes, bw, ref))
    return rows


def bench_w4(
    name: str, bw: float, configs: list, zp: bool, device: str = "cuda", rows: int = 1
) -> list[dict]:
    from pagoda.bench.common import graph_time_per_call
    from pagoda.kernels import fused_ops
    from pagoda.kernels import triton_w4a16_mma as mm
    from pagoda.kernels.triton_fused_mlp import (
        norm_gate_up_silu_w4a16,
        norm_gate_up_silu_w4a16_programs,
    )
    from pagoda.kernels.workspace import SplitKWorkspace

    h, inter = SHAPES[name]
    dev, dt, group = torch.device(device), torch.bfloat16, 128

    def layer(n, k):
        words = torch.randint(-(2**31), 2**31 - 1, (n * k // 8,), device=dev, dtype=torch.int32)
        scale = (torch.rand(k // group, n, device=dev) * 0.02 + 0.001).to(dt)
        zeros = torch.randint(0, 16, (k // group, n), device=dev, dtype=torch.int32)
        return words, mm.repack_mma_scales(scale), mm.repack_mma_zeros(zeros) if zp else None

    nbytes = 3 * h * inter // 2 + 3 * h * inter // group * 2 * (2 if zp else 1)
    copies = _copies(nbytes)
    gu = [layer(2 * inter, h) for _ in range(copies)]
    dn = [layer(h, inter) for _ in range(copies)]
    hid, res = (torch.randn(rows, h, device=dev, dtype=dt) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(h, device=dev, dtype=dt)
    ws = SplitKWorkspace()

    def down(a, i):
        w, s, z = dn[i]
        return mm.wna16_mma_gemv(a, w, s, h, group, zero_pairs=z, workspace=ws)

    def unfused(i):
        x, r = fused_ops.fused_add_rms_norm(hid, res, nw, 1e-6)
        w, s, z = gu[i]
        g = mm.wna16_mma_gemv(x, w, s, 2 * inter, group, zero_pairs=z, workspace=ws)
        return down(fused_ops.silu_and_mul(g), i), r

    results = []
    ref = unfused(0)[0].float()
    t_un = graph_time_per_call(unfused, copies)
    base = {"shape": name, "kind": "w4a16", "zp": zp, "rows": rows, "hidden": h, "inter": inter}
    base["copies"] = copies
    results.append(base | {"variant": "unfused", "us": t_un * 1e6, "bw_frac": nbytes / t_un / bw})
    act = ws.scratch(dev, rows * inter, dt, "act")
    for cfg in configs:
        slots = norm_gate_up_silu_w4a16_programs(hid, inter, cfg)
        xs = ws.scratch(dev, slots * rows * h, dt, "xs")

        def fused(i, cfg=cfg, xs=xs):
            w, s, z = gu[i]
            r = norm_gate_up_silu_w4a16(hid, res, nw, 1e-6, w, s, group, z, act, xs, cfg)
            return down(act[: rows * inter].view(rows, inter), i), r

        got = _measure(fused, ref, copies, f"{name} {cfg}")
        if got is not None:
            results.append(base | _timed("fused", cfg, *got, t_un, nbytes, bw, ref))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="3b,7b")
    p.add_argument("--kinds", default="bf16,w4a16", help="bf16, w4a16, w4a16_zp")
    p.add_argument("--defaults-only", action="store_true", help="no config sweep")
    p.add_argument("--rows", default="1,8", help="W4A16 batch rows (1-8); bf16 takes 1 only")
    ns = p.parse_args()
    shapes = ns.shapes.split(",")
    row_list = [int(r) for r in ns.rows.split(",")]
    if not all(1 <= r <= 8 for r in row_list):
        p.error("--rows: values 1-8")
    kinds = ns.kinds.split(",")
    for s in shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown {s!r}; known: {', '.join(SHAPES)}")
    for k in kinds:
        if k not in ("bf16", "w4a16", "w4a16_zp"):
            p.error(f"--kinds: unknown {k!r}; use bf16, w4a16, w4a16_zp")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from pagoda.bench.common import copy_bandwidth, environment

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    t0 = time.perf_counter()
    rows = []
    for s in shapes:
        for k in kinds:
            if k == "bf16":
                rows += bench_dense(
                    s, bw, dense_configs()[:1] if ns.defaults_only else dense_configs()
                )
            else:
                cfgs = w4_configs()[:1] if ns.defaults_only else w4_configs()
                for m in row_list:
                    rows += bench_w4(s, bw, cfgs, zp=k == "w4a16_zp", rows=m)
            for r in rows:
                if "printed" not in r:
                    r["printed"] = True
                    ratio = r.get("fused_over_unfused")
                    print(
                        f"{s:3s} {k:9s} M={r.get('rows', 1)} {r['variant']:13s} {r['us']:8.2f} us "
                        f"bw {r['bw_frac']:.2f} "
                        + (
                            f"x{ratio:.3f} diff {r['max_abs_diff']:.3g} {r['config']}"
                            if ratio
                            else ""
                        ),
                        flush=True,
                    )
    for r in rows:
        r.pop("printed", None)
    out = {
        "env": environment(dev),
        "copy_bw": bw,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

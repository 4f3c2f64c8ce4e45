"""W4A16 GEMM / GEMV vs bf16 matmul on Qwen2.5-7B linear shapes, M = 1 ... 512 (needs a CUDA GPU).

For each (layer shape, M): cuBLAS bf16 `x @ W.T`, pagoda's Triton dequant-GEMM with its default
config, the best of a small config sweep (to tune `default_config`), and torch's tinygemm
`_weight_int4pack_mm`, timed in a loop by `triton.testing.do_bench` (launch overhead included).
Reports microseconds, speed-up over bf16 and the weight-read bandwidth (bytes of the packed
weight + scales / time) against the GPU's peak, measured in the same run.

The large-M path joins at every M: `wna16_dequant_linear` (the weight expanded into a dense
bf16 scratch by `wna16_dequant`, then cuBLAS), and per shape the dequant pass alone (default
tiles and the best of `dequant_candidate_configs`) in µs and GB/s (packed weight + scales read
+ bf16 weight written), with the M from which the dispatcher takes the path
(`large_m_threshold`, pagoda/kernels/wna16/reference.py) so that the run checks the rule.

For decode sizes (M <= 16) the split-K GEMV `wna16_gemv` joins, and every small-M kernel is also
timed inside a CUDA graph (as decode replays it: no launch overhead, back-to-back kernels)
while rotating over enough weight copies that each call reads its weights from HBM, not from
the L2 that a repeated small layer would otherwise stay in. The GEMV has its default config
and the best of `gemv_candidate_configs` x {split / 2, split, 2 x split} (best printed).
Usage: python benchmarks/quant/bench_w4a16_gemm.py [--out benchmarks/results/w4a16_gemm_h200.json]
       [--gemv-only] (M <= 16 rows only, no GEMM config sweep; meant to take about a minute)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

# (name, N = out_features, K = in_features) of Qwen2.5-7B (hidden 3584, intermediate 18944,
# 28 heads / 4 KV heads of 128): q/k/v fused, o, gate/up fused, down.
SHAPES = [
    ("qkv_proj", 4608, 3584),
    ("o_proj", 3584, 3584),
    ("gate_up_proj", 37888, 3584),
    ("down_proj", 3584, 18944),
]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GEMV_MS = (1, 2, 4, 8, 16)
GROUP = 128


def _sweep_configs(m: int):
    from pagoda.kernels.wna16.triton_w4a16 import GemmConfig

    if m <= 16:
        for block_n in (32, 64, 128):
            for split in (1, 2, 4, 8, 16):
                for warps in (2, 4):
                    yield GemmConfig(16, block_n, 128, split, num_warps=warps, num_stages=4)
    else:
        for bm in (32, 64, 128):
            if bm > max(32, 2 * m):
                continue
            for bn in (64, 128, 256):
                for bk in (64, 128):
                    yield GemmConfig(
                        bm, bn, bk, 1, num_warps=4 if bm * bn <= 8192 else 8, num_stages=3
                    )


def graph_us(calls, reps: int = 48, iters: int = 7) -> float:
    """Median microseconds per call of `reps` calls (cycling over `calls`) in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: compiles, allocates workspaces
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    reps = math.ceil(reps / len(calls)) * len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def _copies(nbytes: int, l2_bytes: int) -> int:
    """Weight copies to rotate over so that a graph's calls stream 4x the L2 from HBM."""
    return max(1, min(32, math.ceil(4 * l2_bytes / nbytes)))


def _cfg_str(cfg, info) -> str:
    path = "dot" if info["use_dot"] else "fma"
    return (
        f"{path} BN={cfg.block_n} BK={info['block_k']} split={info['split_k']} "
        f"warps={cfg.num_warps} stages={cfg.num_stages} {cfg.reduce} grid={info['grid']}"
    )


def gemv_sweep(m, n, k, xs, qts, sts, num_sms, sweep: bool):
    """Default us, default config, best us, best config, default with "atomic" reduction us."""
    from pagoda.kernels.wna16.triton_w4a16 import (
        default_gemv_config,
        gemv_candidate_configs,
        gemv_launch_info,
        wna16_gemv,
    )

    def calls(cfg):
        return [
            functools.partial(wna16_gemv, xs[i % len(xs)], qts[i], sts[i], None, GROUP, 4, cfg)
            for i in range(len(qts))
        ]

    # The heuristic's config, explicitly: with config=None an H200 would use the tuned table
    # (pagoda/kernels/wna16/tuned/w4a16_gemv.json) that this sweep produces.
    heuristic = default_gemv_config(m, n, k, GROUP, 4, num_sms)
    t_default = graph_us(calls(heuristic))
    info = gemv_launch_info(m, n, k, GROUP, 4, heuristic, num_sms)
    best = (t_default, _cfg_str(info["config"], info))
    # M = 1: the default tiles with the 3-kernel reduction (zeroed buffer, atomics, cast).
    t_atomic = None
    if m == 1 and info["split_k"] > 1:
        t_atomic = graph_us(calls(replace(info["config"], reduce="atomic")))
    if sweep:
        for cand in gemv_candidate_configs(m, k, GROUP, 4):
            if n % cand.block_n and cand.block_n >= 1024:
                continue  # a ragged last tile of 1024 columns: not worth a compile
            split0 = gemv_launch_info(m, n, k, GROUP, 4, cand, num_sms)["split_k"]
            for split in sorted({max(1, split0 // 2), split0, 2 * split0}):
                cfg = replace(cand, split_k=split)
                try:
                    t = graph_us(calls(cfg), reps=32, iters=5)
                except Exception as e:  # noqa: BLE001 (a config may not fit in shared memory)
                    print(f"    skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                if t < best[0]:
                    i = gemv_launch_info(m, n, k, GROUP, 4, cfg, num_sms)
                    best = (t, _cfg_str(cfg, i))
    return t_default, _cfg_str(info["config"], info), best[0], best[1], t_atomic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/w4a16_gemm_h200.json")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    parser.add_argument("--no-sweep", action="store_true", help="no GEMM / GEMV config sweeps")
    parser.add_argument("--gemv-only", action="store_true", help="M <= 16, no GEMM sweep")
    parser.add_argument("--no-gemv-sweep", action="store_true")
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from triton.testing import do_bench

    from pagoda.kernels.wna16.reference import large_m_threshold
    from pagoda.kernels.wna16.triton_w4a16 import (
        _num_sms,
        default_config,
        dequant_candidate_configs,
        wna16_dequant,
        wna16_dequant_linear,
        wna16_gemm,
        wna16_gemv,
    )
    from pagoda.quant.packing import pack_to_int32

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    num_sms = props.multi_processor_count
    l2_bytes = getattr(props, "L2_cache_size", 60 << 20)
    ms = [m for m in MS if m in GEMV_MS] if ns.gemv_only else MS
    t_start = time.perf_counter()
    rows = []
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_gbps": ns.peak_gbps,
        "group_size": GROUP,
        "l2_bytes": l2_bytes,
        "rows": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    for name, n, k in SHAPES:
        g = torch.Generator(device="cpu").manual_seed(0)
        # Drawn on the CPU (seeded), packed and expanded on the GPU (136M weights for gate/up).
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8).to(dev)
        scale = (torch.rand(n, k // GROUP, generator=g) * 0.01 + 0.001).to(dev)
        qt = pack_to_int32(q, 4, 1).t().contiguous()  # [K / 8, N]
        st = scale.t().contiguous().to(torch.bfloat16)  # [K / G, N]
        w_bf16 = (q.float() * scale.repeat_interleave(GROUP, 1)).to(torch.bfloat16)
        codes = q.to(torch.int32) + 8
        packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tiny_w = torch._convert_weight_to_int4pack(packed_u8, 8)
        tiny_sz = torch.stack([st, torch.zeros_like(st)], -1).contiguous()
        del codes, packed_u8, q, scale
        weight_bytes = qt.numel() * 4 + st.numel() * 2
        # The dequant pass alone (independent of M): default tiles, then the candidates.
        dq_bytes = weight_bytes + n * k * 2
        dq_cands = dequant_candidate_configs()
        t_dq = do_bench(
            functools.partial(wna16_dequant, qt, st, None, GROUP, 4), warmup=25, rep=100
        )
        dq_best = (t_dq, repr(dq_cands[0]))
        if not (ns.no_sweep or ns.gemv_only):
            for cfg in dq_cands[1:]:
                try:
                    t = do_bench(
                        functools.partial(wna16_dequant, qt, st, None, GROUP, 4, config=cfg),
                        warmup=10,
                        rep=40,
                    )
                except Exception:  # noqa: BLE001 (a config may not fit)
                    continue
                if t < dq_best[0]:
                    dq_best = (t, repr(cfg))
        large_m = large_m_threshold(n, k, 4, num_sms)
        print(
            f"{name:13s} dequant {t_dq * 1e3:7.1f} us ({dq_bytes / (t_dq * 1e-3) / 1e9:.0f} GB/s)"
            f"  best {dq_best[0] * 1e3:7.1f} [{dq_best[1]}]  dequant + cuBLAS from M={large_m}",
            flush=True,
        )
        # Rotated copies for the CUDA-graph timings (decode reads each layer from HBM).
        n_int4 = _copies(weight_bytes, l2_bytes)
        qts = [qt] + [qt.clone() for _ in range(n_int4 - 1)]
        sts = [st] + [st.clone() for _ in range(n_int4 - 1)]
        tinys = [tiny_w] + [tiny_w.clone() for _ in range(n_int4 - 1)]
        tiny_szs = [tiny_sz] + [tiny_sz.clone() for _ in range(n_int4 - 1)]
        w16s = [w_bf16] + [w_bf16.clone() for _ in range(_copies(n * k * 2, l2_bytes) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x @ w_bf16.t()
            t_bf16 = do_bench(functools.partial(torch.matmul, x, w_bf16.t()), warmup=25, rep=100)
            # The heuristic's config, explicitly: config=None would take the tuned table
            # (pagoda/kernels/wna16/tuned/w4a16_gemm.json) that this sweep produces.
            heur = default_config(m, n, k, GROUP, _num_sms(dev))
            out = wna16_gemm(x, qt, st, None, GROUP, 4, heur)
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            t_triton = do_bench(
                functools.partial(wna16_gemm, x, qt, st, None, GROUP, 4, heur), warmup=25, rep=100
            )
            best = (t_triton, "default")
            if not (ns.no_sweep or ns.gemv_only):
                for cfg in _sweep_configs(m):
                    try:
                        t = do_bench(
                            functools.partial(wna16_gemm, x, qt, st, None, GROUP, 4, cfg),
                            warmup=10,
                            rep=40,
                        )
                    except Exception:  # noqa: BLE001 (a config may not fit in shared memory)
                        continue
                    if t < best[0]:
                        best = (t, repr(cfg))
            out = wna16_dequant_linear(x, qt, st, None, GROUP, 4)
            dq_err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            t_dqc = do_bench(
                functools.partial(wna16_dequant_linear, x, qt, st, None, GROUP, 4),
                warmup=25,
                rep=100,
            )
            t_tiny = None
            if m <= 64:
                t_tiny = do_bench(
                    functools.partial(torch._weight_int4pack_mm, x, tiny_w, GROUP, tiny_sz),
                    warmup=25,
                    rep=100,
                )
            row = {
                "layer": name,
                "N": n,
                "K": k,
                "M": m,
                "bf16_us": t_bf16 * 1e3,
                "triton_us": t_triton * 1e3,
                "triton_best_us": best[0] * 1e3,
                "triton_best_config": best[1],
                "tinygemm_us": None if t_tiny is None else t_tiny * 1e3,
                "speedup_triton": t_bf16 / t_triton,
                "speedup_best": t_bf16 / best[0],
                "triton_weight_gbps": weight_bytes / (t_triton * 1e-3) / 1e9,
                "bf16_weight_gbps": n * k * 2 / (t_bf16 * 1e-3) / 1e9,
                "rel_err": err,
                # dequant + cuBLAS (the large-M path) and, repeated per row, the dequant alone
                "dequant_cublas_us": t_dqc * 1e3,
                "speedup_dequant_cublas": t_bf16 / t_dqc,
                "dequant_cublas_rel_err": dq_err,
                "dequant_us": t_dq * 1e3,
                "dequant_gbps": dq_bytes / (t_dq * 1e-3) / 1e9,
                "dequant_best_us": dq_best[0] * 1e3,
                "dequant_best_config": dq_best[1],
                "large_m_threshold": large_m,
                "dispatch": "gemv" if m <= 16 else ("dequant+cublas" if m >= large_m else "gemm"),
            }
            if m in GEMV_MS:
                # Several x's too, so that M = 16 rows do not all hit one cached vector.
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
                out = wna16_gemv(x, qt, st, None, GROUP, 4)
                gerr = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                g_bf16 = graph_us(
                    [functools.partial(torch.matmul, xs[i % 4], w.t()) for i, w in enumerate(w16s)]
                )
                g_tiny = graph_us(
                    [
                        functools.partial(torch._weight_int4pack_mm, xs[i % 4], w, GROUP, sz)
                        for i, (w, sz) in enumerate(zip(tinys, tiny_szs, strict=True))
                    ]
                )
                g_gemm = graph_us(
                    [
                        functools.partial(
                            wna16_gemm, xs[i % 4], qts[i], sts[i], None, GROUP, 4, heur
                        )
                        for i in range(n_int4)
                    ]
                )
                t_gemv, cfg_gemv, t_gemv_best, cfg_best, t_atomic = gemv_sweep(
                    m, n, k, xs, qts, sts, num_sms, not (ns.no_sweep or ns.no_gemv_sweep)
                )
                row.update(
                    {
                        "weight_copies": n_int4,
                        "bf16_graph_us": g_bf16,
                        "tinygemm_graph_us": g_tiny,
                        "triton_graph_us": g_gemm,
                        "gemv_us": t_gemv,
                        "gemv_config": cfg_gemv,
                        "gemv_atomic_reduce_us": t_atomic,
                        "gemv_best_us": t_gemv_best,
                        "gemv_best_config": cfg_best,
                        "gemv_speedup_bf16": g_bf16 / t_gemv,
                        "gemv_best_speedup_bf16": g_bf16 / t_gemv_best,
                        "gemv_weight_gbps": weight_bytes / (t_gemv * 1e-6) / 1e9,
                        "gemv_best_weight_gbps": weight_bytes / (t_gemv_best * 1e-6) / 1e9,
                        "gemv_rel_err": gerr,
                    }
                )
            rows.append(row)
            # Rewritten after every row: a run cut short by a timeout keeps what it measured.
            Path(ns.out).write_text(json.dumps(record, indent=2) + "\n")
            tiny = "-" if t_tiny is None else f"{t_tiny * 1e3:.1f}"
            print(
                f"{name:13s} M={m:4d} bf16 {row['bf16_us']:8.1f} us  triton "
                f"{row['triton_us']:8.1f} (best {row['triton_best_us']:8.1f})  tinygemm {tiny:>8s}"
                f"  x{row['speedup_triton']:.2f}  {row['triton_weight_gbps']:.0f} GB/s"
                f"  dq+cuBLAS {t_dqc * 1e3:8.1f} (x{row['speedup_dequant_cublas']:.2f}, "
                f"err {dq_err:.1e})",
                flush=True,
            )
            if m in GEMV_MS:
                print(
                    f"{'':13s} graph: bf16 {g_bf16:6.1f}  tinygemm {g_tiny:6.1f}  gemm "
                    f"{g_gemm:6.1f}  GEMV {t_gemv:6.1f} (x{row['gemv_speedup_bf16']:.2f}, "
                    f"{row['gemv_weight_gbps']:.0f} GB/s)  best {t_gemv_best:6.1f} "
                    f"[{cfg_best}]  err {gerr:.1e}  ({time.perf_counter() - t_start:.0f} s)",
                    flush=True,
                )
        del qts, sts, tinys, tiny_szs, w16s, w_bf16, tiny_w, qt, st
        torch.cuda.empty_cache()
    print(
        f"| layer | M | bf16 µs | W4A16 µs | best cfg µs | tinygemm µs | × bf16 | % of "
        f"{ns.peak_gbps:.0f} GB/s | dequant + cuBLAS µs | dispatch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tiny = "-" if r["tinygemm_us"] is None else f"{r['tinygemm_us']:.1f}"
        print(
            f"| {r['layer']} | {r['M']} | {r['bf16_us']:.1f} | {r['triton_us']:.1f} | "
            f"{r['triton_best_us']:.1f} | {tiny} | {r['speedup_triton']:.2f} | "
            f"{100 * r['triton_weight_gbps'] / ns.peak_gbps:.0f} | "
            f"{r['dequant_cublas_us']:.1f} | {r['dispatch']} |"
        )
    print(
        "\nDequant pass alone (packed weight + scales read, bf16 weight written):\n"
        f"| layer | dequant µs | GB/s | % of {ns.peak_gbps:.0f} GB/s | best µs | best config | "
        "dequant + cuBLAS from M |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["M"] != ms[0]:
            continue
        print(
            f"| {r['layer']} | {r['dequant_us']:.1f} | {r['dequant_gbps']:.0f} | "
            f"{100 * r['dequant_gbps'] / ns.peak_gbps:.0f} | {r['dequant_best_us']:.1f} | "
            f"{r['dequant_best_config']} | {r['large_m_threshold']} |"
        )
    print(
        "\nDecode sizes, CUDA graph, weights read from HBM (µs per call):\n"
        f"| layer | M | bf16 | tinygemm | Triton GEMM | GEMV | GEMV best | GEMV × bf16 | "
        f"GEMV % of {ns.peak_gbps:.0f} GB/s | best config |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "gemv_us" not in r:
            continue
        print(
            f"| {r['layer']} | {r['M']} | {r['bf16_graph_us']:.1f} | "
            f"{r['tinygemm_graph_us']:.1f} | {r['triton_graph_us']:.1f} | {r['gemv_us']:.1f} | "
            f"{r['gemv_best_us']:.1f} | {r['gemv_speedup_bf16']:.2f} | "
            f"{100 * r['gemv_weight_gbps'] / ns.peak_gbps:.0f} | {r['gemv_best_config']} |"
        )


if __name__ == "__main__":
    main()

"""W4A16 GEMM vs bf16 matmul on Qwen2.5-7B linear shapes, M = 1 ... 512 (needs a CUDA GPU).

For each (layer shape, M): cuBLAS bf16 `x @ W.T`, pagoda's Triton dequant-GEMM with its default
config, the best of a small config sweep (to tune `default_config`), and torch's tinygemm
`_weight_int4pack_mm`. Reports microseconds, speed-up over bf16 and the weight-read bandwidth
(bytes of the packed weight + scales / time) against the GPU's peak, measured in the same run.
Usage: python benchmarks/quant/bench_w4a16_gemm.py [--out benchmarks/results/w4a16_gemm_h200.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
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
GROUP = 128


def _sweep_configs(m: int):
    from pagoda.kernels.triton_w4a16 import GemmConfig

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/w4a16_gemm_h200.json")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    parser.add_argument("--no-sweep", action="store_true")
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from triton.testing import do_bench

    from pagoda.kernels.triton_w4a16 import wna16_gemm
    from pagoda.kernels.wna16 import pack_to_int32

    dev = torch.device("cuda")
    rows = []
    for name, n, k in SHAPES:
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // GROUP, generator=g) * 0.01 + 0.001
        qt = pack_to_int32(q, 4, 1).t().contiguous().to(dev)  # [K / 8, N]
        st = scale.t().contiguous().to(dev, torch.bfloat16)  # [K / G, N]
        w_bf16 = (q.float() * scale.repeat_interleave(GROUP, 1)).to(dev, torch.bfloat16)
        codes = (q.to(torch.int32) + 8).to(dev)
        packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tiny_w = torch._convert_weight_to_int4pack(packed_u8, 8)
        tiny_sz = torch.stack([st, torch.zeros_like(st)], -1).contiguous()
        weight_bytes = qt.numel() * 4 + st.numel() * 2
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x @ w_bf16.t()
            t_bf16 = do_bench(functools.partial(torch.matmul, x, w_bf16.t()), warmup=25, rep=100)
            out = wna16_gemm(x, qt, st, None, GROUP, 4)
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            t_triton = do_bench(
                functools.partial(wna16_gemm, x, qt, st, None, GROUP, 4), warmup=25, rep=100
            )
            best = (t_triton, "default")
            if not ns.no_sweep:
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
            }
            rows.append(row)
            tiny = "-" if t_tiny is None else f"{t_tiny * 1e3:.1f}"
            print(
                f"{name:13s} M={m:4d} bf16 {row['bf16_us']:8.1f} us  triton "
                f"{row['triton_us']:8.1f} (best {row['triton_best_us']:8.1f})  tinygemm {tiny:>8s}"
                f"  x{row['speedup_triton']:.2f}  {row['triton_weight_gbps']:.0f} GB/s",
                flush=True,
            )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_gbps": ns.peak_gbps,
        "group_size": GROUP,
        "rows": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"| layer | M | bf16 µs | W4A16 µs | best cfg µs | tinygemm µs | × bf16 | % of "
        f"{ns.peak_gbps:.0f} GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tiny = "-" if r["tinygemm_us"] is None else f"{r['tinygemm_us']:.1f}"
        print(
            f"| {r['layer']} | {r['M']} | {r['bf16_us']:.1f} | {r['triton_us']:.1f} | "
            f"{r['triton_best_us']:.1f} | {tiny} | {r['speedup_triton']:.2f} | "
            f"{100 * r['triton_weight_gbps'] / ns.peak_gbps:.0f} |"
        )


if __name__ == "__main__":
    main()

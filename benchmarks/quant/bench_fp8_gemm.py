"""FP8 linears per layer at M = 1-256 against bf16 cuBLAS, Qwen2.5-7B and 3B shapes (sm_90).

Paths: `bf16` (cuBLAS on the dense weight, the denominator), `w8a8` (what `fp8_scaled_mm` runs:
the Triton per-token quantization launch, then cuBLASLt's FP8 GEMM), `gemv` (`fp8_gemv`, M = 1),
`gemm` (`fp8_gemm`: FP8 weights x bf16 rows through `tl.dot`, its default config), `a8`
(`fp8_gemm_a8`: the same quantization launch, then `fp8_gemm`'s FP8 x FP8 `tl.dot`; `a8_dot`
the dot alone) and, with `--sweep`, `gemm_best` / `a8_best` (the fastest of
`triton_gemm.candidate_configs`; `--sweep-seconds` caps the sweep). Each is timed inside one
CUDA graph over weight copies that stream > 4x the L2 per replay
(`pagoda.bench.common.graph_time_per_call`) and checked first against the fp32 reference.

    python benchmarks/quant/bench_fp8_gemm.py --out DIR [--models 3b,7b] [--ms 2,8,64] [--sweep]
        [--sweep-ms 64,128] [--sweep-seconds 120]
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

from pagoda.bench.common import environment  # noqa: E402
from pagoda.bench.common import graph_time_per_call as time_graph  # noqa: E402
from pagoda.kernels.fp8 import triton_gemm as tg  # noqa: E402
from pagoda.kernels.fp8.ops import fp8_gemv_ref, scaled_mm  # noqa: E402
from pagoda.kernels.fp8.triton_gemv import fp8_gemv  # noqa: E402
from pagoda.kernels.fp8.triton_quant import quant_fp8_triton  # noqa: E402
from pagoda.kernels.workspace import SplitKWorkspace  # noqa: E402

SHAPES = {  # model: {layer: (N, K)}
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "3b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)},
}
MS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]
WS = SplitKWorkspace()  # split-K scratch, as the model runner owns one


def _copies(nbytes: int, l2: int) -> int:
    return max(2, -(-4 * l2 // max(nbytes, 1)))


def _sweep(make, copies, m, n, k, sms, first, deadline) -> tuple[float, str]:
    best = first
    for c in tg.candidate_configs(m, n, k, sms):
        if time.time() > deadline:
            break
        try:
            t = time_graph(make(c), copies, replays=10, reps=3) * 1e6
        except Exception as e:  # noqa: BLE001 - a config that does not compile
            print(f"  {c}: {type(e).__name__}", flush=True)
            continue
        best = min(best, (t, repr(c)))
    return best


def bench_layer(
    n: int, k: int, ms: list[int], sweep_ms: set[int], l2: int, dev, deadline: float
) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    nf = _copies(n * k, l2)
    nd = _copies(2 * n * k, l2)
    wq = [
        (torch.randn(n, k, device=dev, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        for _ in range(nf)
    ]
    scale = torch.rand(n, device=dev, generator=g) * 1e-3 + 1e-4
    dense = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(nd)]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    srow = scale.view(1, n)

    def gemm(x, c):
        return lambda i: tg.fp8_gemm(x, wq[i], scale, config=c, workspace=WS)

    def a8(x, c, quant=True):
        xq0, xs0 = quant_fp8_triton(x, None)

        def run(i):
            xq, xs = quant_fp8_triton(x, None) if quant else (xq0, xs0)
            return tg.fp8_gemm(
                xq, wq[i], scale, config=c, workspace=WS, x_scale=xs, out_dtype=x.dtype
            )

        return run

    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        row = {"n": n, "k": k, "m": m}
        row["bf16_us"] = time_graph(lambda i, x=x: F.linear(x, dense[i]), nd) * 1e6

        def w8a8(i, x=x):
            xq, xs = quant_fp8_triton(x, None)
            return scaled_mm(xq, xs, wq[i], srow, None, torch.bfloat16)

        row["w8a8_us"] = time_graph(w8a8, nf) * 1e6
        want = fp8_gemv_ref(x, wq[0], scale, None).float()
        if m == 1:
            err = (fp8_gemv(x, wq[0], scale).float() - want).abs().max().item()
            row["gemv_us"] = time_graph(lambda i, x=x: fp8_gemv(x, wq[i], scale), nf) * 1e6
            row["gemv_err"] = err
        if m <= tg.MAX_M:
            cfg = tg.default_config(m, n, k, sms)
            got = tg.fp8_gemm(x, wq[0], scale, config=cfg, workspace=WS).float()
            row["gemm_err"] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-9)
            row["gemm_config"] = repr(cfg)
            row["gemm_us"] = time_graph(gemm(x, cfg), nf) * 1e6
            xq, xs = quant_fp8_triton(x, None)
            want8 = scaled_mm(xq, xs, wq[0], srow, None, torch.bfloat16).float()
            got8 = a8(x, cfg)(0).float()
            row["a8_err"] = (got8 - want8).abs().max().item() / max(want8.abs().max().item(), 1e-9)
            row["a8_us"] = time_graph(a8(x, cfg), nf) * 1e6
            row["a8_dot_us"] = time_graph(a8(x, cfg, quant=False), nf) * 1e6
            if m in sweep_ms:
                row["gemm_best_us"], row["gemm_best_config"] = _sweep(
                    lambda c, x=x: gemm(x, c), nf, m, n, k, sms,
                    (row["gemm_us"], repr(cfg)), deadline,
                )  # fmt: skip
                row["a8_best_us"], row["a8_best_config"] = _sweep(
                    lambda c, x=x: a8(x, c), nf, m, n, k, sms,
                    (row["a8_us"], repr(cfg)), deadline,
                )  # fmt: skip
        rows.append(row)
        fast = min(
            v for kk, v in row.items() if kk.endswith("_us") and kk not in ("bf16_us", "a8_dot_us")
        )
        print(
            f"N={n} K={k} M={m}: "
            + " ".join(f"{kk[:-3]} {v:.1f}" for kk, v in row.items() if kk.endswith("_us"))
            + f" us; best FP8 / bf16 time {fast / row['bf16_us']:.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="3b,7b")
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-ms", default="", help="the rows swept (default: every --ms)")
    p.add_argument("--sweep-seconds", type=float, default=1e9, help="stop sweeping after")
    p.add_argument("--commit", default="unknown")
    a = p.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    ms = [int(m) for m in a.ms.split(",")]
    res = {"env": environment(dev), "commit": a.commit, "rows": {}}
    t0 = time.time()
    sweep_ms = set()
    if a.sweep:
        sweep_ms = {int(m) for m in a.sweep_ms.split(",")} if a.sweep_ms else set(ms)
    deadline = t0 + a.sweep_seconds
    for model in a.models.split(","):
        for layer in a.layers.split(","):
            n, k = SHAPES[model][layer]
            rows = bench_layer(n, k, ms, sweep_ms, l2, dev, deadline)
            res["rows"][f"{model}/{layer}"] = rows
    res["seconds"] = time.time() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemm.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""The batch-1 GEMVs with the decoder's norm / activation as their prologue, against the separate
kernel + the plain GEMV, per Qwen2.5-3B / 7B layer, bf16 (dense GEMV) and W4A16 (tensor-core
GEMV), timed back to back in one CUDA graph (PDL-chained as in the decode graph, weight copies
cycled so every call streams from HBM). Columns, µs per call:

- `gemv`: the plain GEMV alone (what the layer costs without the op);
- `separate`: the RMSNorm (+ residual) or SiLU-and-mul kernel, then the plain GEMV;
- `prologue`: one GEMV with the op as its prologue (the default config, then, with `--sweep`,
  W4A16 split-K variants: every program of a split reads the whole row for the norm's sum of
  squares, so fewer splits read the row fewer times).

    python benchmarks/bench_prologue.py --out benchmarks/results/prologue_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagoda.bench.common import cuda_device, environment, write_result  # noqa: E402
from pagoda.bench.common import graph_time_per_call as time_graph  # noqa: E402
from pagoda.kernels import fused_ops  # noqa: E402
from pagoda.kernels import triton_gemv as dg  # noqa: E402
from pagoda.kernels import triton_w4a16_mma as mma  # noqa: E402
from pagoda.kernels.workspace import SplitKWorkspace  # noqa: E402

SHAPES = {  # model: {layer: (N, K, prologue)}
    "3b": {"qkv": (2560, 2048, "norm"), "gate_up": (22016, 2048, "norm"),
           "down": (2048, 11008, "silu")},
    "7b": {"qkv": (4608, 3584, "norm"), "gate_up": (37888, 3584, "norm"),
           "down": (3584, 18944, "silu")},
}  # fmt: skip
GROUP = 128
WS = SplitKWorkspace()


def _copies(bytes_per_copy: int, l2: int) -> int:
    return max(2, -(-4 * l2 // bytes_per_copy))


def bench_layer(model: str, layer: str, n: int, k: int, op: str, sweep: bool, dev, l2) -> list:
    g = torch.Generator(device=dev).manual_seed(n + k)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    r = torch.randn(1, k, device=dev, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).bfloat16()
    gu = torch.randn(1, 2 * k, device=dev, generator=g).bfloat16()
    dense = [
        (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
        for _ in range(_copies(n * k * 2, l2))
    ]
    wc = _copies(n * k // 2, l2)
    words = [
        torch.randint(-(2**31), 2**31 - 1, (n * k // 8,), device=dev, dtype=torch.int32,
                      generator=g)
        for _ in range(wc)
    ]  # fmt: skip
    pairs = [
        mma.repack_mma_scales(
            (torch.rand(k // GROUP, n, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
        )
        for _ in range(wc)
    ]

    def op_input():
        if op == "norm":
            return fused_ops.fused_add_rms_norm(x, r, nw, 1e-6)[0]
        return fused_ops.silu_and_mul(gu)

    def bf16_prologue(i):
        if op == "norm":
            return dg.gemv_add_rms_norm(x, r, nw, 1e-6, dense[i])[0]
        return dg.gemv_silu_and_mul(gu, dense[i])

    def w4_prologue(i, config=None):
        if op == "norm":
            return mma.wna16_mma_gemv_add_rms_norm(
                x, r, nw, 1e-6, words[i], pairs[i], n, GROUP, workspace=WS, config=config
            )[0]
        return mma.wna16_mma_gemv_silu_and_mul(
            gu, words[i], pairs[i], n, GROUP, workspace=WS, config=config
        )

    def w4(a, i):
        return mma.wna16_mma_gemv(a, words[i], pairs[i], n, GROUP, workspace=WS)

    xin = x if op == "norm" else gu[:, :k].contiguous()
    rows = []
    for kind, plain, prologue, copies in (
        ("bf16", lambda a, i: dg.gemv_bf16(a, dense[i]), bf16_prologue, len(dense)),
        ("w4a16", w4, w4_prologue, wc),
    ):
        # The prologue's result against the separate kernels' (one bf16 ulp of the output).
        want, got = plain(op_input(), 0).float(), prologue(0).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        row = {"model": model, "layer": layer, "n": n, "k": k, "op": op, "kind": kind}
        row["max_rel_err"] = err
        row["gemv_us"] = time_graph(lambda i, p=plain: p(xin, i), copies) * 1e6
        row["separate_us"] = time_graph(lambda i, p=plain: p(op_input(), i), copies) * 1e6
        row["prologue_us"] = time_graph(prologue, copies) * 1e6
        if sweep and kind == "w4a16":
            sms = (
                torch.cuda.get_device_properties(dev).multi_processor_count
                if dev.type == "cuda"
                else 4
            )
            kt, split, warps = mma.default_mma_config(1, n, k, sms)
            for s in sorted({1, 2, 4, 8, 16} - {split}):
                cfg = (kt, s, warps)
                row[f"prologue{list(cfg)}_us"] = (
                    time_graph(lambda i, c=cfg: w4_prologue(i, c), copies) * 1e6
                )
        row["saved_us"] = row["separate_us"] - row["prologue_us"]
        rows.append(row)
        extra = "  ".join(
            f"{key[8:-3]} {v:6.1f}" for key, v in row.items() if key.startswith("prologue[")
        )
        print(
            f"{model} {layer:8s} {kind:6s} gemv {row['gemv_us']:6.1f}  separate "
            f"{row['separate_us']:6.1f}  prologue {row['prologue_us']:6.1f}  saved "
            f"{row['saved_us']:5.1f}  err {err:.1e}  {extra}",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="3b,7b")
    ap.add_argument("--sweep", action="store_true", help="W4A16 prologue split-K variants")
    ns = ap.parse_args()
    unknown = sorted(set(ns.models.split(",")) - set(SHAPES))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    dev = cuda_device("bench_prologue.py")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for model in ns.models.split(","):
        for layer, (n, k, op) in SHAPES[model].items():
            rows += bench_layer(model, layer, n, k, op, ns.sweep, dev, l2)
    write_result(ns.out, {"env": environment(dev), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

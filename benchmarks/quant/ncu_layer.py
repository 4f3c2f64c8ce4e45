"""Launch one W4A16 layer's kernel and the bf16 cuBLAS GEMM of the same shape a few times each,
for Nsight Compute to profile (no timing here: ncu replays each profiled launch).

Why: the TMA-fed wgmma GEMM (`gluon_wgmma_tma`) runs 7B gate_up at M = 128 at ~57 % of the bf16
tensor rate (BENCHMARKS.md, session 16); its counters (tensor-pipe activity, issue stalls,
DRAM throughput) decide what to change next. Each launch reads a different weight copy, as
in the per-layer benchmark, so the profiled launches stream from HBM.

    ncu --clock-control none --kernel-name regex:'^kernel$|nvjet|xmma|cutlass' \\
        --launch-count 6 --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/quant/ncu_layer.py --model 7b --layer gate_up --m 128 --kernel tma
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.quant.bench_w4a16_tc import GROUP, SHAPES, WS, Layer  # noqa: E402
from pagoda.bench.common import cuda_device  # noqa: E402
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layer", default="gate_up")
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--kernel", default="tma", choices=("tma", "mwg", "gemv"))
    ap.add_argument("--zp", action="store_true", help="zero points (AWQ) instead of symmetric")
    ap.add_argument("--launches", type=int, default=3, help="launches of each kernel")
    ns = ap.parse_args()
    if ns.layer not in SHAPES[ns.model]:
        ap.error(f"--layer must be one of {', '.join(SHAPES[ns.model])}")
    dev = cuda_device("ncu_layer.py")
    n, k = SHAPES[ns.model][ns.layer]
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    layer = Layer(n, k, l2, ns.zp, dev)
    x = torch.randn(ns.m, k, device=dev).bfloat16()

    def w4(i: int) -> torch.Tensor:
        args = (x, layer.words[i], layer.pairs[i], n, GROUP)
        kw = dict(zero_pairs=layer.z(i), workspace=WS)
        if ns.kernel == "tma":
            from pagoda.kernels.wna16 import gluon_wgmma_tma as tk

            return tk.wna16_wgmma_tma(*args, **kw)
        if ns.kernel == "mwg":
            from pagoda.kernels.wna16 import gluon_mma_wgmma as mwg

            return mwg.wna16_mma_wgmma(*args, **kw)
        return mma.wna16_mma_gemv(*args, **kw)

    # The launches to profile come first (W4A16, then bf16), the check after them.
    y = [w4(i % len(layer.words)) for i in range(ns.launches)][0]
    for i in range(ns.launches):
        F.linear(x, layer.dense[i % len(layer.dense)])
    ref = x.float() @ layer.w_ref.t()
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"{ns.model} {ns.layer} N={n} K={k} M={ns.m} {ns.kernel}: max rel err {err:.2e}")
    return 0 if err <= 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())

"""One layer's wgmma W4A16 GEMM, called a few times, for a profiler (H200):

    ncu --clock-control none --launch-skip 3 --launch-count 1 -k regex:kernel \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python benchmarks/quant/profile_mwg.py --n 37888 --k 3584 --m 64

Random weights in the `repack_mma` layout, group 128, the default config (or --config).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.kernels.wna16 import gluon_mma_wgmma as mwg  # noqa: E402
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402
from pagoda.kernels.workspace import SplitKWorkspace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=37888)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--config", default=None, help="BLOCK_M,warpgroups,split,stages,natural")
    ap.add_argument("--calls", type=int, default=6)
    ns = ap.parse_args()
    dev = torch.device("cuda")
    words = torch.randint(-(2**31), 2**31 - 1, (ns.n * ns.k // 8,), dtype=torch.int32, device=dev)
    scales = (torch.rand(ns.k // 128, ns.n, device=dev) * 0.004 + 0.001).bfloat16()
    pairs = mma.repack_mma_scales(scales)
    x = torch.randn(ns.m, ns.k, device=dev).bfloat16()
    config = tuple(int(v) for v in ns.config.split(",")) if ns.config else None
    ws = SplitKWorkspace()
    for _ in range(ns.calls):
        mwg.wna16_mma_wgmma(x, words, pairs, ns.n, 128, workspace=ws, config=config)
    torch.cuda.synchronize()
    print("config", config or mwg.default_wgmma_config(ns.m, ns.n, ns.k, 132))


if __name__ == "__main__":
    main()

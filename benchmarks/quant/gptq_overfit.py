"""Does GPTQ fit its calibration tokens better than it generalises? Per matrix, in / out of sample.

Runs `pagoda quantize --method gptq` with 2N calibration samples, each linear's Hessian split
by sample: the even samples' H_a is what GPTQ solves with (N samples, the protocol's count),
the odd samples' H_b is held out. For every matrix it records the layer-output error
tr(ΔW H ΔWᵀ) of GPTQ and of round-to-nearest (same scales search, same group size) on H_a and on
H_b. GPTQ minimises the first; where its held-out error approaches or passes RTN's, the solve
fits noise in N x T tokens rather than the layer's input statistics.
Usage: python benchmarks/quant/gptq_overfit.py --model X.gguf --dataset calib.txt
       [--num-samples 64] [--group-size 128] [--scheme W4A16] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import pagoda.quantizer.pipeline as pipeline
from pagoda.model_files import default_model_path
from pagoda.quantizer import quantize
from pagoda.quantizer.gptq import HessianAccumulator
from pagoda.quantizer.rtn import hessian_weighted_error, rtn_quantize

HELD_OUT: dict[int, torch.Tensor] = {}  # id(H_a) -> H_b of the same linear input
MODULES = ("qkv", "o", "gate_up", "down")  # the pipeline's GPTQ calls per decoder layer


class SplitHessian(HessianAccumulator):
    """Even calls (samples) into this accumulator, odd ones into `twin`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.twin = HessianAccumulator(*args, **kwargs)
        self.calls = 0

    def add(self, x: torch.Tensor) -> None:
        if self.calls % 2 == 0:
            super().add(x)
        else:
            self.twin.add(x)
        self.calls += 1

    @property
    def hessian(self) -> torch.Tensor:
        h = HessianAccumulator.hessian.fget(self)
        HELD_OUT[id(h)] = self.twin.hessian
        return h


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--num-samples", type=int, default=64, help="GPTQ's samples (x2 are drawn)")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--scheme", default="W4A16")
    p.add_argument("--dampening", type=float, default=0.01)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    ns = p.parse_args()

    real_gptq = pipeline.gptq_quantize
    rows: list[dict] = []

    def measured(w, h, args, *rest, **kwargs):
        result = real_gptq(w, h, args, *rest, **kwargs)
        h_b = HELD_OUT.pop(id(h))
        rtn = rtn_quantize(w, args, torch.bfloat16).dequantize(torch.float32)
        i = len(rows)
        row = {"layer": i // len(MODULES), "module": MODULES[i % len(MODULES)]}
        row["shape"] = list(w.shape)
        for name, hh in (("in", h), ("out", h_b)):
            row[f"gptq_{name}"] = hessian_weighted_error(w, result.dequantized, hh)
            row[f"rtn_{name}"] = hessian_weighted_error(w, rtn, hh)
            row[f"ratio_{name}"] = row[f"gptq_{name}"] / max(row[f"rtn_{name}"], 1e-30)
        rows.append(row)
        print(
            f"layer {row['layer']:2d} {row['module']:8s} GPTQ / RTN error: in-sample "
            f"{row['ratio_in']:.3f}, held-out {row['ratio_out']:.3f}",
            flush=True,
        )
        return result

    pipeline.gptq_quantize = measured
    pipeline.HessianAccumulator = SplitHessian
    model = ns.model or default_model_path()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        quantize(model, Path(tmp) / "q", method="gptq", scheme=ns.scheme,
                 group_size=ns.group_size, dataset=ns.dataset, num_samples=2 * ns.num_samples,
                 max_seq_len=ns.max_seq_len, seed=0, device="cpu", actorder="static",
                 dtype="bfloat16", dampening=ns.dampening, progress=False)  # fmt: skip
    worse = [r for r in rows if r["ratio_out"] >= 1.0]
    summary = {
        "model": str(model),
        "commit": ns.commit,
        "settings": {k: v for k, v in vars(ns).items() if k not in ("out", "commit")},
        "seconds": time.time() - t0,
        "median_ratio_in": float(torch.tensor([r["ratio_in"] for r in rows]).median()),
        "median_ratio_out": float(torch.tensor([r["ratio_out"] for r in rows]).median()),
        "held_out_worse_than_rtn": [f"{r['layer']}.{r['module']}" for r in worse],
        "modules": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "modules"}, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()

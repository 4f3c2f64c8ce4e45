"""GPTQ's objective with min-max group scales vs the searched ones, on the same W and H.

Runs `pagoda quantize --method gptq` on a model's first layers; for every matrix GPTQ is called
on, it also runs GPTQ with plain min-max scales (the searched scales' predecessor) and RTN, and
records tr(ΔW H ΔWᵀ) of each (the layer-output error on the calibration tokens).
Usage: python benchmarks/quant/gptq_scale_search.py --dataset calib.txt [--model X.gguf]
       [--group-size 64] [--layers 1] [--out result.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch

import pagoda.quantizer.gptq as gptq
import pagoda.quantizer.pipeline as pipeline
from pagoda.model_files import default_model_path
from pagoda.quantizer import quantize
from pagoda.quantizer.rtn import compute_qparams, hessian_weighted_error, rtn_quantize


class _Enough(Exception):
    """Raised once the requested layers are measured (the rest of the model is not needed)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()

    searched_qparams = gptq.search_qparams
    real_gptq = gptq.gptq_quantize
    rows: list[dict] = []
    per_layer = 4  # qkv, o, gate_up, down: the pipeline's GPTQ calls per decoder layer

    def both(w, h, args, *rest, **kwargs):
        gptq.search_qparams = lambda c, a, d, importance=None: compute_qparams(c, a, d)
        minmax = real_gptq(w, h, args, *rest, **kwargs)
        gptq.search_qparams = searched_qparams
        searched = real_gptq(w, h, args, *rest, **kwargs)
        rtn = rtn_quantize(w, args, torch.bfloat16).dequantize(torch.float32)
        rows.append(
            {
                "shape": list(w.shape),
                "rtn": hessian_weighted_error(w, rtn, h),
                "gptq_minmax": hessian_weighted_error(w, minmax.dequantized, h),
                "gptq_searched": hessian_weighted_error(w, searched.dequantized, h),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if len(rows) >= per_layer * ns.layers:
            raise _Enough
        return searched

    pipeline.gptq_quantize = both
    model = ns.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(_Enough):
        quantize(model, Path(tmp) / "q", method="gptq", scheme="W4A16",
                 group_size=ns.group_size, dataset=ns.dataset, num_samples=ns.num_samples,
                 max_seq_len=ns.max_seq_len, seed=0, device="cpu", actorder="static",
                 dtype="bfloat16", progress=False)  # fmt: skip
    for row in rows:
        row["searched_vs_minmax"] = row["gptq_searched"] / row["gptq_minmax"]
    result = {"model": str(model), "group_size": ns.group_size, "modules": rows}
    print(json.dumps([round(r["searched_vs_minmax"], 3) for r in rows]))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

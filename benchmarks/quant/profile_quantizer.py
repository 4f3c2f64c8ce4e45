"""Where a quantizer's time goes: GPTQ or AWQ on the first N layers of a real model shape
(random weights, random calibration tokens), with a Python profile, the device's kernel
totals and the seconds of each layer. Also times one Hessian update (X^T X of a chunk)
in float32 against the half-precision GEMM with a float32 result.

    python benchmarks/quant/profile_quantizer.py --config benchmarks/configs/qwen2.5-7b.json \
        --layers 2 --methods gptq,awq --num-samples 256 --max-seq-len 2048 --out OUT.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.quantizer.api import quantize  # noqa: E402
from pagoda.quantizer.gptq import HessianAccumulator  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_hessian(width: int, tokens: int, device: str, repeats: int = 3) -> dict:
    """Seconds of one chunk's X^T X update: float32 inputs against bf16 inputs."""
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    out = {}
    for name, xs in (("float32", x.float()), ("bfloat16", x)):
        best = float("inf")
        for _ in range(repeats):
            acc = HessianAccumulator(width, device, chunk_tokens=tokens)
            _sync()
            t0 = time.perf_counter()
            acc.add(xs)
            _ = acc.hessian
            _sync()
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    out["ratio"] = out["float32"] / out["bfloat16"]
    return out


def profile_method(config: dict, method: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(config))
        prof = cProfile.Profile()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        _sync()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=activities) as tprof:
            prof.enable()
            report = quantize(
                f"config:{cfg_path}",
                Path(tmp) / "out",
                method=method,
                dataset="random",
                num_samples=args.num_samples,
                max_seq_len=args.max_seq_len,
                progress=False,
            )
            prof.disable()
        _sync()
        wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    kernels = tprof.key_averages().table(
        sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
        row_limit=args.top,
    )
    layers = [round(layer.seconds, 2) for layer in report.layers]
    print(f"== {method}: {wall:.1f} s for {len(layers)} layers; per layer {layers}")
    print(text.getvalue())
    print(kernels)
    return {"method": method, "wall_s": wall, "layer_s": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--methods", default="gptq,awq")
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    config = json.loads(Path(args.config).read_text())
    config["num_hidden_layers"] = args.layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "commit": args.commit,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "config": args.config,
        "layers": args.layers,
        "num_samples": args.num_samples,
        "max_seq_len": args.max_seq_len,
    }
    if device == "cuda":
        widths = sorted({config["hidden_size"], config["intermediate_size"]})
        result["hessian_update_s"] = {w: time_hessian(w, 16384, device) for w in widths}
        print("hessian update (16,384 tokens):", json.dumps(result["hessian_update_s"]))
    result["runs"] = [profile_method(config, m, args) for m in args.methods.split(",")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    for run in result["runs"]:
        print(json.dumps(run))


if __name__ == "__main__":
    main()

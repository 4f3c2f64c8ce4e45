"""Qwen2.5-VL-3B-shape batch-1 decode on the GPU without Triton, bf16 against
W4A16 (PyTorch's int4 matmul), capability 8.7 (Orin) emulated, each engine in its own process
with Triton hidden. Reports decode tok/s (batch 1 and 4), a 2048-token prefill, peak
activations, the CUDA graph sizes captured and the quantized layers' layout; the target is
W4A16 >= 1.2x bf16 at batch 1, peak activations <= 2 GiB, CUDA graphs on.

    python benchmarks/deploy/no_triton_decode.py --out benchmarks/results/<name>/no_triton.json
"""

from __future__ import annotations

import sys

sys.modules["triton"] = None  # before anything imports it: `import triton` fails, find_spec None

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks/configs/qwen2.5-vl-3b.json"


def child(job: dict) -> dict:
    """One engine in this process: start, measure, shut down."""
    import torch

    from pagoda import LLM, SamplingParams, platform
    from pagoda.bench.edge import _decode_rate

    assert not platform.triton_available()
    t0 = time.perf_counter()
    llm = LLM(
        job["model"],
        tokenizer=job["tokenizer"],
        max_model_len=job["max_model_len"],
        limit_mm_per_prompt={"image": 1},
        print_memory_report=False,
    )
    startup = time.perf_counter() - t0
    report = llm.memory_report()
    model = llm.llm_engine.core.runner.model
    layouts = sorted({m.wna16_backend for m in model.modules() if hasattr(m, "wna16_backend")})
    _decode_rate(llm, 1, 32)  # warm-up
    decode = {str(b): _decode_rate(llm, b, job["output_len"]) for b in (1, 4)}
    prompt = [[100 + (i * 7) % 5000 for i in range(job.get("prefill_len", 2048))]]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt, one, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompt, one, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    result = {
        "model": job["model"],
        "device": report.device,
        "capability_seen": list(platform.capability(next(model.parameters()).device)),
        "torch": torch.__version__,
        "triton_modules": sorted(
            k for k in sys.modules if k.split(".")[0] == "triton" and sys.modules[k]
        ),
        "wna16_layouts": layouts,
        "startup_s": startup,
        "decode_tok_s": decode,
        "prefill_len": len(prompt[0]),
        "prefill_s": prefill_s,
        "peak_activation_gib": report.peak_activation_bytes / 2**30,
        "weights_gib": report.weights_bytes / 2**30,
        "cuda_graph_sizes": report.cuda_graph_sizes,
        "memory_report": report.to_dict(),
    }
    llm.shutdown()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/qwen2.5-tokenizer"))
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--capability", default="8.7")
    p.add_argument("--commit", default="", help="the commit measured (the device's .git is stale)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        Path(job["result"]).write_text(json.dumps(child(job)))
        return 0

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PAGODA_EMULATE_CAPABILITY": args.capability, "PYTHONUNBUFFERED": "1"}
    results = {}
    for name, model in (("bf16", f"config:{CONFIG}"), ("w4a16", f"config:{CONFIG}:w4a16")):
        res_file = out.with_name(f"{out.stem}.{name}.json")
        job = {
            "model": model,
            "tokenizer": args.tokenizer,
            "max_model_len": args.max_model_len,
            "output_len": args.output_len,
            "result": str(res_file),
        }
        cmd = [sys.executable, __file__, "--out", str(out), "--child", json.dumps(job)]
        subprocess.run(cmd, env=env, check=True, timeout=300)
        results[name] = json.loads(res_file.read_text())
        res_file.unlink()
    bf16, w4 = results["bf16"], results["w4a16"]
    ratio = w4["decode_tok_s"]["1"] / bf16["decode_tok_s"]["1"]
    summary = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "emulated_capability": args.capability,
        "w4a16_over_bf16_batch1": ratio,
        "targets_met": {
            "w4a16_ge_1.2x_bf16": ratio >= 1.2,
            "peak_activations_le_2gib": max(r["peak_activation_gib"] for r in results.values())
            <= 2.0,
            "cuda_graphs_on": all(r["cuda_graph_sizes"] for r in results.values()),
            "no_triton": not any(r["triton_modules"] for r in results.values()),
        },
        "results": results,
    }
    out.write_text(json.dumps(summary, indent=2))
    brief = {k: v for k, v in summary.items() if k != "results"}
    for name, r in results.items():
        brief[name] = {
            k: r[k]
            for k in (
                "decode_tok_s",
                "prefill_s",
                "peak_activation_gib",
                "cuda_graph_sizes",
                "wna16_layouts",
                "startup_s",
                "device",
                "capability_seen",
            )
        }
        mem = r["memory_report"]  # where the activation peak comes from
        brief[name]["encoder_activation_gib"] = mem.get("encoder_activation_bytes", 0) / 2**30
        brief[name]["encoder_profile_input"] = mem.get("encoder_profile_input", "")
    print(json.dumps(brief, indent=1))
    return 0 if all(summary["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

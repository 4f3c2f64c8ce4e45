"""Why does TTFT differ from one engine instance to the next? (W4A16 on the H200: 22-62 ms)

Builds the engine as `pagoda bench latency` does, measures the time to first token of fresh
512-token prompts a few times (as that bench does), then profiles one more prefill with
torch.profiler: GPU busy time vs wall time and the top kernels. Run it in several processes and
compare a slow instance with a fast one.

    python benchmarks/profile_prefill.py config:benchmarks/configs/qwen2.5-7b.json:w4a16 --out F
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    ns = p.parse_args()
    llm = LLM(ns.model, dtype="bfloat16", max_num_seqs=8, skip_tokenizer_init=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    base = [(7 * i) % 10000 for i in range(ns.prompt_len)]
    llm.generate([base], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    res: dict = {"model": ns.model, "ttft_s": [], "prefill_wall_s": []}
    for i in range(ns.iters):
        prompt = [(t + i + 1) % 10000 for t in base]
        t0 = time.perf_counter()
        m = llm.generate([prompt], first, use_tqdm=False)[0].metrics
        res["prefill_wall_s"].append(time.perf_counter() - t0)
        res["ttft_s"].append(m.first_token_time - m.arrival_time)
    from torch.profiler import ProfilerActivity, profile

    prompt = [(t + 99) % 10000 for t in base]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        torch.cuda.synchronize()
        res["profiled_wall_s"] = time.perf_counter() - t0
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.key_averages() if e.device_type == cuda]
    res["profiled_gpu_s"] = (
        sum(e.device_time_total for e in prof.events() if e.device_type == cuda) / 1e6
    )
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:15]
    res["top_kernels_us"] = [(e.key[:90], e.count, e.device_time_total) for e in top]
    Path(ns.out).write_text(json.dumps(res, indent=1))
    print(
        "TTFT ms", [round(t * 1e3, 1) for t in res["ttft_s"]],
        "| profiled wall ms", round(res["profiled_wall_s"] * 1e3, 1),
        "GPU ms", round(res["profiled_gpu_s"] * 1e3, 1),
    )  # fmt: skip
    for name, count, us in res["top_kernels_us"]:
        print(f"  {us:9.0f} us  x{count:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

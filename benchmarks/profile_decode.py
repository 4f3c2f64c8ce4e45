"""Where does a batch-1 decode step go? (issue 3: the MBU gap, with the profile that shows it)

Splits one decode step of the engine into: the CUDA graph of the decoder alone (replayed back to
back, so no host time), the graph + lm_head + argmax, and the engine's full step (host work
included); then a torch.profiler trace of engine decode steps gives GPU busy time vs wall time
and the top kernels, and each weight shape's M=1 matmul is timed against the copy bandwidth.

    python benchmarks/profile_decode.py config:benchmarks/configs/qwen2.5-7b.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.common import copy_bandwidth


def timed(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    ns = p.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    llm = LLM(
        ns.model,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        skip_tokenizer_init=True,
    )
    runner = llm.llm_engine.core.runner
    model = runner.model
    prompt = [[(7 * i) % 10000 for i in range(ns.prompt_len)]]
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)

    res: dict = {"copy_bandwidth_bytes_per_s": bw}
    # 1. engine step, host included
    prompt = [[t + 1 for t in prompt[0]]]
    m = llm.generate(prompt, sp, use_tqdm=False)[0].metrics
    res["engine_step_s"] = (m.finished_time - m.first_token_time) / (ns.output_len - 1)

    # 2. the size-1 decode graph alone, and with lm_head + argmax (no host work between)
    gr = runner.graph_runner
    g = gr.graphs[1]
    res["graph_replay_s"] = timed(g.replay, 200)
    hid = gr.outputs[1]

    def graph_logits_argmax() -> None:
        g.replay()
        model.compute_logits(hid).argmax(-1)

    res["graph_logits_argmax_s"] = timed(graph_logits_argmax, 200)
    res["logits_argmax_s"] = timed(lambda: model.compute_logits(hid).argmax(-1), 200)

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    res["weight_bytes_read"] = weights - emb.numel() * emb.element_size()
    for k in ("engine_step_s", "graph_replay_s", "graph_logits_argmax_s"):
        res[k.replace("_s", "_mbu")] = res["weight_bytes_read"] / res[k] / bw

    # 3. profiler over engine decode steps
    from torch.profiler import ProfilerActivity, profile

    prompt = [[t + 2 for t in prompt[0]]]
    short = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt, short, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    gpu_us = sum(
        e.device_time_total
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
    )
    res["profile_wall_s"] = wall
    res["profile_gpu_kernel_s"] = gpu_us / 1e6
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    (out / "profile_kernels.txt").write_text(table)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    (out / "profile_cpu.txt").write_text(cpu_table)
    try:
        prof.export_chrome_trace(str(out / "trace.json"))
    except Exception as e:  # noqa: BLE001
        print("trace export failed:", e, file=sys.stderr)

    # 4. each weight's M=1 matmul vs the copy bandwidth
    rows = []
    seen = set()
    for name, prm in model.named_parameters():
        if (
            prm.dim() != 2
            or not prm.is_floating_point()  # packed int4/int8 weights: not a plain matmul
            or "embed" in name
            or tuple(prm.shape) in seen
        ):
            continue
        seen.add(tuple(prm.shape))
        x = torch.randn(1, prm.shape[1], device=dev, dtype=prm.dtype)
        t = timed(lambda x=x, w=prm: torch.nn.functional.linear(x, w), 200)
        rows.append(
            {
                "name": name,
                "shape": list(prm.shape),
                "time_us": t * 1e6,
                "bw_frac": prm.numel() * prm.element_size() / t / bw,
            }
        )
    res["m1_matmuls"] = rows
    (out / "profile_decode.json").write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        if k != "m1_matmuls":
            print(f"{k:28s} {v}")
    for r in rows:
        print(f"  {r['name']:50s} {r['shape']} {r['time_us']:.1f} us {r['bw_frac'] * 100:.0f}%")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

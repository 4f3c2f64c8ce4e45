"""Where does a batch-1 decode step go? (issue 3: the MBU gap, with the profile that shows it)

Splits one decode step of the engine into: the CUDA graph of the decoder alone (replayed back to
back, so no host time), the graph + lm_head + argmax, and the engine's full step (host work
included); then a torch.profiler trace of engine decode steps gives GPU busy time vs wall time
and the top kernels, and each weight shape's M=1 matmul is timed against the copy bandwidth.

    python benchmarks/profile_decode.py config:benchmarks/configs/qwen2.5-7b.json --out DIR

`--batch B` does the same for a decode step of B sequences (B prompts; the graph of the
smallest captured size >= B; each weight's matmul at M = B); `--kv-cache-dtype fp8` with an FP8
cache. The graph replay is a pure decode step at the context the last step had (prompt +
output), with no prefill mixed in: the measure of decode at long context.
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
from pagoda.bench.common import wall_time_per_call as timed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences a decode step (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    )
    ns = p.parse_args()
    if not 1 <= ns.batch <= 512:
        p.error(f"--batch must be in 1..512, got {ns.batch}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    llm = LLM(
        ns.model,
        dtype="bfloat16",
        max_model_len=ns.max_model_len or max(4096, ns.prompt_len + ns.output_len + 64),
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_num_seqs=max(8, ns.batch),
        skip_tokenizer_init=True,
        kv_cache_dtype=ns.kv_cache_dtype,
    )
    runner = llm.llm_engine.core.runner
    model = runner.model
    b = ns.batch
    prompts = [[(7 * i + 13 * j) % 10000 for i in range(ns.prompt_len)] for j in range(b)]
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)

    res: dict = {"copy_bandwidth_bytes_per_s": bw, "batch": b}
    # 1. engine step, host included
    prompts = [[t + 1 for t in p] for p in prompts]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["engine_step_s"] = max(
        (o.metrics.finished_time - o.metrics.first_token_time) / (ns.output_len - 1) for o in outs
    )

    # 2. the decode graph alone, and with lm_head + argmax (no host work between)
    gr = runner.graph_runner
    # graphs are keyed by (batch size, block-table width): the smallest size >= b, the widest
    key = min((s, -w) for s, w in gr.graphs if s >= b)
    key = (key[0], -key[1])
    res["graph_size"] = key[0]
    g = gr.graphs[key]
    res["graph_replay_s"] = timed(g.replay, 200)
    hid = gr.outputs[key]

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

    prompts = [[t + 2 for t in p] for p in prompts]
    short = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, short, use_tqdm=False)
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

    # 4. each weight's M = batch matmul vs the copy bandwidth
    rows = []
    seen = set()
    for name, prm in model.named_parameters():
        if (
            prm.dim() != 2
            or not prm.is_floating_point()  # packed int4/int8 weights: not a plain matmul
            or prm.element_size() == 1  # FP8 weights: a scaled matmul
            or "embed" in name
            or tuple(prm.shape) in seen
        ):
            continue
        seen.add(tuple(prm.shape))
        x = torch.randn(b, prm.shape[1], device=dev, dtype=prm.dtype)
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

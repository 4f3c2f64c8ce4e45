"""`pagoda bench throughput`: offline throughput on the nano-vllm workload.

256 requests, prompt and output lengths each uniform in [100, 1024], random token ids, seed 0,
ignore_eos; all submitted at once. Reports output tok/s and total (prompt + output) tok/s, and
the same workload through transformers' continuous batching (`generate_batch`'s manager, with
each request's own output length) in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from pagoda.bench.common import (
    Workload,
    environment,
    free_device_memory,
    hf_model_from_config,
    random_workload,
    write_result,
)
from pagoda.entrypoints.cli_args import (
    add_async_scheduling_arg,
    add_model_arg,
    add_speculative_config_arg,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--min-out", type=int, default=100)
    p.add_argument("--max-out", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache element type (fp8: e4m3, one byte; scales from the checkpoint or 1.0)",
    )
    add_async_scheduling_arg(p)
    add_speculative_config_arg(p)
    p.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="run transformers on the first N requests only (it is slow)",
    )
    p.add_argument("--out", default=None)


def run_pagoda(ns: argparse.Namespace, workloads: list[Workload]) -> list[dict[str, Any]]:
    """One engine, each workload timed on its own (prefix cache reset in between)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        ns.model,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enforce_eager=ns.enforce_eager,
        async_scheduling=ns.async_scheduling,
        speculative_config=ns.speculative_config,
        kv_cache_dtype=ns.kv_cache_dtype,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        skip_tokenizer_init=True,
    )
    warm = SamplingParams(temperature=ns.temperature, max_tokens=16, ignore_eos=True)
    llm.generate(workloads[0].prompts[:8], warm, use_tqdm=False)
    results = []
    for wl in workloads:
        llm.llm_engine.core.kv_cache_manager.reset_prefix_cache()
        params = [
            SamplingParams(temperature=ns.temperature, max_tokens=n, ignore_eos=True)
            for n in wl.output_lens
        ]
        steps0 = llm.llm_engine.core.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
        results.append(
            {
                "num_requests": len(wl.prompts),
                "elapsed_s": elapsed,
                "output_tok_s": produced / elapsed,
                "total_tok_s": (produced + wl.num_prompt_tokens) / elapsed,
                "steps": llm.llm_engine.core.num_steps - steps0,
                "preemptions": llm.llm_engine.core.num_preemptions,
                "async_scheduling": llm.llm_engine.core.async_scheduling,
            }
        )
    results[0]["memory_report"] = llm.memory_report().to_dict()
    del llm, outs
    free_device_memory()
    return results


def run_transformers(ns: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    from transformers import GenerationConfig

    from pagoda.engine.args import EngineArgs

    _, model_config, *_ = EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device
    ).create_configs()
    device = torch.device("cuda" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    model = hf_model_from_config(model_config.hf_config, getattr(torch, model_config.dtype), device)
    gen_cfg = GenerationConfig(
        max_new_tokens=max(wl.output_lens),
        do_sample=ns.temperature > 0,
        temperature=ns.temperature if ns.temperature > 0 else None,
        eos_token_id=None,
        pad_token_id=0,
    )
    manager = model.init_continuous_batching(generation_config=gen_cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n)
            for p, n in zip(wl.prompts, wl.output_lens, strict=True)
        ]
        produced, done = 0, 0
        while done < len(ids):
            r = manager.get_result(timeout=60)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if r.is_finished():
                done += 1
                produced += len(r.generated_tokens)
                if done % 32 == 0:
                    print(f"  transformers: {done}/{len(ids)} requests", file=sys.stderr)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    del model, manager
    free_device_memory()
    return {
        "elapsed_s": elapsed,
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + wl.num_prompt_tokens) / elapsed,
        "output_tokens": produced,
    }


def main(ns: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    from pagoda.engine.args import EngineArgs

    _, mc, *_ = EngineArgs(model=ns.model, device=ns.device).create_configs()
    wl = random_workload(
        ns.num_requests,
        ns.min_len,
        ns.max_len,
        ns.min_out,
        ns.max_out,
        mc.text_config.vocab_size,
        seed=0,
    )
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": ns.model,
        "num_requests": ns.num_requests,
        "prompt_tokens": wl.num_prompt_tokens,
        "output_tokens": wl.num_output_tokens,
        "env": environment(device),
    }
    # pagoda first (its result is written at once), then the baseline in the same process
    n = ns.baseline_requests or ns.num_requests
    subset = Workload(wl.prompts[:n], wl.output_lens[:n])
    print("pagoda ...", file=sys.stderr)
    runs = run_pagoda(ns, [wl] + ([subset] if n < ns.num_requests else []))
    result["pagoda"] = p = runs[0]
    if len(runs) > 1:
        result["pagoda_on_baseline_subset"] = runs[1]
    write_result(ns.out, result)
    if ns.baseline == "transformers":
        print("transformers baseline ...", file=sys.stderr)
        result["transformers_requests"] = n
        result["transformers"] = run_transformers(ns, subset)
    print(f"\n{'engine':<14}{'time s':>9}{'output tok/s':>14}{'total tok/s':>13}")
    for name in ("pagoda", "transformers"):
        if name in result:
            r = result[name]
            print(
                f"{name:<14}{r['elapsed_s']:>9.1f}{r['output_tok_s']:>14.1f}"
                f"{r['total_tok_s']:>13.1f}"
            )
    if "pagoda_on_baseline_subset" in result:
        r = result["pagoda_on_baseline_subset"]
        print(
            f"{'pagoda (' + str(n) + ')':<14}{r['elapsed_s']:>9.1f}{r['output_tok_s']:>14.1f}"
            f"{r['total_tok_s']:>13.1f}"
        )
    if "transformers" in result:
        hf = result["transformers"]["output_tok_s"]
        result["speedup_output_tok_s"] = p["output_tok_s"] / hf
        same = result.get("pagoda_on_baseline_subset", p)["output_tok_s"] / hf
        result["speedup_output_tok_s_same_requests"] = same
        print(
            f"output tok/s vs transformers: {result['speedup_output_tok_s']:.1f}x "
            f"({same:.1f}x on the same {n} requests)"
        )
    write_result(ns.out, result)
    return 0

"""`pagoda bench latency`: one request, fixed prompt and output length, TTFT and decode speed.

Reports time to first token, decode tokens/s and MBU — the bytes a decode step must read
(weights it multiplies with + the KV cache of the context) over the step time, as a fraction of
the device copy bandwidth measured in the same run — and the same workload on transformers
(`generate`, same shape, same dtype), so every figure comes with a ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

import torch

from pagoda.bench.common import (
    copy_bandwidth,
    environment,
    free_device_memory,
    hf_model_from_config,
    write_result,
)
from pagoda.entrypoints.cli_args import (
    add_async_scheduling_arg,
    add_model_arg,
    add_speculative_config_arg,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, help="model dir, .gguf, or config:benchmarks/configs/qwen2.5-7b.json")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
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
    p.add_argument("--out", default=None, help="write the JSON result here")


def _decode_bytes(llm: Any, prompt_len: int, output_len: int, batch: int) -> tuple[float, float]:
    """(weight bytes read per decode step, mean KV bytes read per step)."""
    model = llm.llm_engine.core.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    cfg = llm.llm_engine.model_config
    tied = getattr(cfg.text_config, "tie_word_embeddings", False)
    if emb is not None and not tied:  # an untied input embedding is gathered, not read whole
        weights -= sum(p.numel() * p.element_size() for p in emb.parameters())
    per_token_kv = (
        2
        * cfg.num_layers
        * cfg.num_kv_heads
        * cfg.head_dim
        * llm.llm_engine.core.runner.dtype.itemsize
    )
    mean_ctx = prompt_len + output_len / 2
    return float(weights), float(per_token_kv * mean_ctx * batch)


def run_pagoda(ns: argparse.Namespace) -> dict[str, Any]:
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
        max_num_seqs=max(ns.batch_size, 8),
        skip_tokenizer_init=True,
    )
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.text_config.vocab_size
    prompts = [
        [rng.randrange(0, min(vocab, 10000)) for _ in range(ns.prompt_len)]
        for _ in range(ns.batch_size)
    ]
    full = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.llm_engine.core.kv_cache_manager.reset_prefix_cache()
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    ttfts, decode_rates, step_times, accepted_lengths = [], [], [], []
    for i in range(ns.iters):
        # fresh ids every iteration so no prefix-cache hit shortens the prefill
        prompts = [[(t + i + 1) % min(vocab, 10000) for t in p] for p in prompts]
        t = llm.generate(prompts, first, use_tqdm=False)[0].metrics
        ttfts.append(t.first_token_time - t.arrival_time)
        # The same prompts again: their blocks are in the prefix cache now, so every sequence
        # starts decoding within a step or two and the decode window of request 0 holds decode
        # steps of the whole batch only (fresh prompts would put the other sequences'
        # prefill chunks into it: at 16 x 8,192 tokens most of its time).
        m = llm.generate(prompts, full, use_tqdm=False)[0].metrics
        if m.spec_mean_accepted_length is not None:
            accepted_lengths.append(m.spec_mean_accepted_length)
        decode_time = m.finished_time - m.first_token_time
        steps = ns.output_len - 1
        step_times.append(decode_time / steps)
        decode_rates.append(steps * ns.batch_size / decode_time)
        print(
            f"  iter {i}: TTFT {ttfts[-1] * 1e3:.1f} ms, decode {decode_rates[-1]:.1f} tok/s",
            file=sys.stderr,
        )
    w_bytes, kv_bytes = _decode_bytes(llm, ns.prompt_len, ns.output_len, ns.batch_size)
    report = llm.memory_report().to_dict()
    step = statistics.median(step_times)
    result = {
        "ttft_s": statistics.median(ttfts),
        "decode_tok_s": statistics.median(decode_rates),
        "decode_step_s": step,
        "weight_bytes_per_step": w_bytes,
        "kv_bytes_per_step": kv_bytes,
        "achieved_bytes_per_s": (w_bytes + kv_bytes) / step,
        "async_scheduling": llm.llm_engine.core.async_scheduling,
        # speculative decoding: tokens emitted per verify step (request 0), median over iters
        "spec_mean_accepted_length": (
            statistics.median(accepted_lengths) if accepted_lengths else None
        ),
        "memory_report": report,
    }
    del llm
    free_device_memory()
    return result


def run_transformers(ns: argparse.Namespace) -> dict[str, Any]:
    from pagoda.engine.args import EngineArgs

    args = EngineArgs(model=ns.model, dtype=ns.dtype, device=ns.device)
    _, model_config, *_ = args.create_configs()
    device = torch.device(
        "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    dtype = getattr(torch, model_config.dtype)
    model = hf_model_from_config(model_config.hf_config, dtype, device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    vocab = model_config.text_config.vocab_size
    ids = torch.randint(0, min(vocab, 10000), (ns.batch_size, ns.prompt_len), generator=g)
    ids = ids.to(device)

    def gen(n: int, model: Any = model) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        import time

        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(4)  # warm-up
    ttfts, rates = [], []
    for _ in range(ns.iters):
        t1 = gen(1)
        tn = gen(ns.output_len)
        ttfts.append(t1)
        rates.append((ns.output_len - 1) * ns.batch_size / (tn - t1))
    del model
    free_device_memory()
    return {"ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(rates)}


def main(ns: argparse.Namespace) -> int:
    device = torch.device(
        "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    bw = copy_bandwidth(device)
    result: dict[str, Any] = {
        "benchmark": "latency",
        "model": ns.model,
        "batch_size": ns.batch_size,
        "prompt_len": ns.prompt_len,
        "output_len": ns.output_len,
        "env": environment(device),
        "copy_bandwidth_bytes_per_s": bw,
    }
    if ns.baseline == "transformers":
        print("transformers baseline ...", file=sys.stderr)
        result["transformers"] = run_transformers(ns)
    print("pagoda ...", file=sys.stderr)
    result["pagoda"] = p = run_pagoda(ns)
    if bw == bw:  # not NaN: GPU
        p["mbu"] = p["achieved_bytes_per_s"] / bw
    if "transformers" in result:
        hf = result["transformers"]
        result["speedup_decode"] = p["decode_tok_s"] / hf["decode_tok_s"]
        result["speedup_ttft"] = hf["ttft_s"] / p["ttft_s"]
        if bw == bw:
            hf["mbu"] = (
                (p["weight_bytes_per_step"] + p["kv_bytes_per_step"])
                * hf["decode_tok_s"]
                / ns.batch_size
                / bw
            )
    rows = [("pagoda", p)] + (
        [("transformers", result["transformers"])] if "transformers" in result else []
    )
    print(f"\n{'engine':<14}{'TTFT ms':>10}{'decode tok/s':>14}{'MBU':>8}")
    for name, r in rows:
        mbu = f"{r['mbu'] * 100:.1f}%" if "mbu" in r else "-"
        print(f"{name:<14}{r['ttft_s'] * 1e3:>10.1f}{r['decode_tok_s']:>14.1f}{mbu:>8}")
    if "speedup_decode" in result:
        print(f"decode speed-up vs transformers: {result['speedup_decode']:.2f}x")
    write_result(ns.out, result)
    return 0

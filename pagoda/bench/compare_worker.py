"""One configuration of `pagoda compare`, measured in a fresh process.

`python -m pagoda.bench.compare_worker --job JOB.json --out RESULT.json` loads one model (the
pagoda engine, or transformers as the baseline), measures memory, TTFT, decode speed per batch
size, throughput and perplexity, and writes one JSON result, rewritten after every finished
measurement (`"complete": false` until the last), so an interrupted run keeps what it measured;
`--resume` skips the measurements a previous result already has. A process per configuration
keeps device memory and allocator peaks clean. Progress goes to stderr as `@@progress <phase>`
lines and `@@bar <done> <total> <phase>` lines (the parent draws one bar per phase).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import resource
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.heldout import HELDOUT_NAME, heldout_text

PROGRESS_PREFIX = "@@progress "
BAR_PREFIX = "@@bar "
ERROR_PREFIX = "@@error "
GiB = 1 << 30
# Prompts draw ids below this so every vocabulary gets the same ids (as in `pagoda bench`).
_MAX_PROMPT_ID = 10000


@dataclass(frozen=True)
class CompareJob:
    """What one worker measures; written by `pagoda compare`, read by the worker."""

    label: str
    model: str
    engine: str = "pagoda"  # "pagoda" | "transformers"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    enforce_eager: bool = False
    prompt_len: int = 512
    output_len: int = 256
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    iters: int = 2
    throughput_requests: int = 256
    ppl_text: str | None = None
    ppl_window: int = 512
    seed: int = 0
    cpu_threads: int | None = None  # torch intra-op threads; None: torch's default

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompareJob:
        d = dict(d)
        d["batch_sizes"] = tuple(d.get("batch_sizes", (1, 8, 64)))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["batch_sizes"] = list(self.batch_sizes)
        return d


def progress(msg: str) -> None:
    print(f"{PROGRESS_PREFIX}{msg}", file=sys.stderr, flush=True)


def bar(done: int, total: int, phase: str) -> None:
    print(f"{BAR_PREFIX}{done} {total} {phase}", file=sys.stderr, flush=True)


class ResultFile:
    """The worker's JSON result, replaced atomically after each measurement."""

    def __init__(self, path: Path | None, previous: dict[str, Any] | None = None) -> None:
        self.path = path
        self.previous = previous or {}

    def has(self, key: str, sub: str | None = None) -> bool:
        value = self.previous.get(key)
        return value is not None and (sub is None or sub in (value or {}))

    def save(self, result: dict[str, Any], complete: bool = False) -> None:
        if self.path is None:
            return
        result["complete"] = complete
        tmp = self.path.with_name(self.path.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def disk_size_gib(model: str) -> float | None:
    """Bytes of the checkpoint's weight files (safetensors / GGUF), None for dummy configs."""
    from pagoda.model_files import resolve_model

    source = resolve_model(None if model == "default" else model)
    if source.kind == "gguf":
        return os.path.getsize(source.path) / GiB
    if source.kind != "hf_dir":
        return None
    files = list(Path(source.path).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / GiB if files else None


def is_gguf(model: str) -> bool:
    from pagoda.model_files import resolve_model

    return resolve_model(None if model == "default" else model).kind == "gguf"


# ---------------------------------------------------------------------- shared helpers

DEFAULT_PPL_TEXT_NAME = f"{HELDOUT_NAME}, held out from calibration (without --ppl-text)"


def default_ppl_text() -> str:
    return heldout_text()


# Greedy answers compared with the reference configuration's (`pagoda compare` reports how
# many are identical and how many of the reference's tokens each one reproduces).
GREEDY_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
    "How many days are there in a leap year?",
    "Explain in one sentence what a list is in Python.",
    "What is 12 times 7?",
    "Translate 'thank you' into Spanish.",
    "What does a CPU do?",
)
GREEDY_MAX_TOKENS = 32


def standard_workload_lengths(max_model_len: int) -> tuple[int, int, int, int]:
    """(min_len, max_len, min_out, max_out) of `pagoda bench throughput`, shrunk to fit."""
    lo, hi = 100, 1024
    scale = min(1.0, max_model_len / (2 * hi))  # prompt + output must fit in max_model_len
    return (
        max(1, int(lo * scale)),
        max(2, int(hi * scale)),
        max(1, int(lo * scale)),
        max(2, int(hi * scale)),
    )


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    hi = min(vocab, _MAX_PROMPT_ID)
    return [[rng.randrange(0, hi) for _ in range(length)] for _ in range(n)]


def _peak_memory(device: Any) -> dict[str, Any]:
    """In-process peaks: allocator statistics on GPU, resident set size everywhere."""
    import torch

    # Linux reports ru_maxrss in KiB.
    out: dict[str, Any] = {
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        out.update(
            peak_allocated_gib=torch.cuda.max_memory_allocated(device) / GiB,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GiB,
            # CUDA context, cuBLAS/Triton modules, NCCL: device memory torch does not track.
            # Meaningless on integrated GPUs, where "used" includes the OS and page cache.
            non_torch_gib=max(0, total - free - reserved) / GiB,
            device_total_gib=total / GiB,
        )
    return out


def _ttft_runs(iters: int) -> int:
    # One prefill at batch 1 is cheap next to a decode run: more samples, a steadier median.
    return max(5, iters)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v == v]  # drop None and NaN
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------- pagoda


def _check_quantization(llm: Any) -> dict[str, Any]:
    """Which linear layers run quantized; fail when a quantized spec loaded unquantized."""
    from pagoda.layers.linear import LinearBase, UnquantizedLinearMethod

    engine = llm.llm_engine
    model = engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    quantized = [m for m in linears if not isinstance(m.linear_method, UnquantizedLinearMethod)]
    qc = engine.model_config.quantization
    requested = _scheme_name(qc) if qc is not None else None
    override = engine.source.quant_override or ""
    scheme, _, head_spec = override.partition("-")
    if requested is None and scheme in ("w4a16", "w8a16", "fp8"):
        requested = scheme.upper()
    if requested and not quantized:
        raise ValueError(
            f"{engine.source.name}: {requested} was requested but every linear layer loaded "
            "unquantized (quantized loading is not available in this build)"
        )
    # The LM head is not a LinearBase: reported on its own (quantized, dense or tied).
    head = getattr(model, "lm_head", None)
    lm_head = None
    if head is not None:
        if getattr(head, "quantized", False):
            lm_head = "quantized"
        else:
            lm_head = "tied to the embeddings (dense)" if getattr(head, "tied", False) else "dense"
    if head_spec == "lm_head" and lm_head == "dense":
        raise ValueError(
            f"{engine.source.name}: a quantized lm_head was requested ({override}) but it "
            "loaded dense"
        )
    # the method and, where it has several layouts, which one runs (fp8 tensor cores or the
    # dense W8A16 fallback; the W4A16 kernel layout)
    methods = sorted(
        {
            type(m.linear_method).__name__
            + "".join(
                f" [{getattr(m, a)}]" for a in ("fp8_backend", "wna16_backend") if hasattr(m, a)
            )
            for m in quantized
        }
    )
    if lm_head == "quantized":
        methods = sorted({*methods, type(head.linear_method).__name__})
    return {
        "quantization": requested,
        "quantized_linear_layers": len(quantized),
        "linear_layers": len(linears),
        "linear_methods": methods,
        "lm_head": lm_head,
    }


def _scheme_name(qc: dict[str, Any]) -> str:
    """A name like W4A16 g128 for a compressed-tensors or legacy GPTQ quantization_config."""
    groups = qc.get("config_groups") or {}
    group = next(iter(groups.values()), None) or {}
    weights = group.get("weights") or {}
    if qc.get("quant_method") == "fp8":
        return "FP8_DYNAMIC (quantized at load)"
    if weights.get("type") == "float":
        acts = group.get("input_activations") or {}
        return "FP8_DYNAMIC" if acts.get("dynamic") else "FP8 (static activations)"
    bits = weights.get("num_bits") or qc.get("bits")
    group = weights.get("group_size") or qc.get("group_size")
    name = f"W{bits}A16" if bits else str(qc.get("quant_method") or "quantized")
    return f"{name} g{group}" if group and group > 0 else name


def _decode_rate(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Tokens/s of the decode phase: from the step where every request has its first token
    until the last one finishes. Prefill (chunked, possibly mixed with early decodes) is
    excluded, so the figure is the steady decode speed at this batch size. Requests go to the
    engine core directly: no per-step RequestOutput building in the timed loop."""
    from pagoda.engine.request import Request
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False
    )
    core = engine.core
    preempt0 = core.num_preemptions
    reqs = [Request(f"decode-{engine.next_request_id()}", p, params) for p in prompts]
    for r in reqs:
        core.add_request(r)
    t_start, tokens_at_start = None, 0
    while core.has_unfinished_requests():
        core.step()
        if t_start is None and all(r.num_output_tokens > 0 for r in reqs):
            t_start = time.perf_counter()
            tokens_at_start = sum(r.num_output_tokens for r in reqs)
    t_end = time.perf_counter()
    tokens = sum(r.num_output_tokens for r in reqs) - tokens_at_start
    elapsed = t_end - t_start if t_start is not None else 0.0
    return {
        "tok_s": tokens / elapsed if elapsed > 0 and tokens > 0 else float("nan"),
        "decode_tokens": tokens,
        "decode_s": elapsed,
        "preemptions": core.num_preemptions - preempt0,
    }


def run_pagoda(job: CompareJob, out: ResultFile | None = None) -> dict[str, Any]:
    import torch

    from pagoda.bench.common import environment, random_workload
    from pagoda.engine.args import EngineArgs
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    progress("loading")
    # Resolving the configs once first imports transformers' config modules (seconds), so
    # the start-up time below is the engine's, not the interpreter's.
    EngineArgs(model=job.model, dtype=job.dtype, device=job.device).create_configs()
    t0 = time.perf_counter()
    llm = LLM(
        job.model,
        dtype=job.dtype,
        device=job.device,
        max_model_len=job.max_model_len,
        gpu_memory_utilization=job.gpu_memory_utilization,
        max_num_seqs=job.max_num_seqs,
        enforce_eager=job.enforce_eager,
        kv_cache_dtype=job.kv_cache_dtype,
        seed=job.seed,
        print_memory_report=False,
    )
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    runner = engine.core.runner
    device = runner.device
    report = llm.memory_report()
    result: dict[str, Any] = {
        "label": job.label,
        "engine": "pagoda",
        "model": job.model,
        "model_name": engine.source.name,
        "dtype": engine.model_config.dtype,
        "device": str(device),
        "env": environment(device),
        "load_average_start": os.getloadavg(),
        "notes": [],
    }
    result.update(_check_quantization(llm))
    disk = disk_size_gib(job.model)
    source_disk = None
    if is_gguf(job.model):
        # The engine runs the dequantized model: that is the full-precision configuration,
        # so its size is what a full-precision checkpoint holds; the GGUF file is shown apart.
        source_disk, disk = disk, report.weights_bytes / GiB
        result["notes"].append(
            f"{job.label}: dequantized from {Path(engine.source.path).name} "
            f"({source_disk:.3g} GiB on disk) to {engine.model_config.dtype}; its weight rows "
            "are the dequantized model's (the full-precision reference), the GGUF file's size "
            "is the 'source file' row"
        )
    result.update(
        weights_gib=report.weights_bytes / GiB,
        weights_disk_gib=disk,
        source_disk_gib=source_disk,
        kv_cache_gib=report.kv_cache_bytes / GiB,
        kv_tokens=report.kv_token_capacity,
        max_concurrency=report.max_concurrency,
        load_s=report.load_time_s,
        startup_s=startup_s,
        # None when no graphs were captured (CPU, enforce_eager): "—" in the table, not 0
        cuda_graph_s=report.cuda_graph_capture_time_s if report.cuda_graph_sizes else None,
        memory_budget_gib=report.memory_budget_bytes / GiB,
        memory_report=report.to_dict(),
    )
    if device.type != "cuda":
        result["notes"].append(
            "CPU: the engine sizes the KV cache for max_num_seqs full-length sequences (at most "
            "1 GiB), not from free memory, so KV capacity does not grow when the weights shrink"
        )
        if str(result.get("quantization") or "").startswith("W4A16"):
            disk = result["weights_disk_gib"]
            on_disk = f" (on disk, 4-bit packed: {disk:.3g} GiB)" if disk else ""
            result["notes"].append(
                f"{job.label}: on CPU, W4A16 weights are held as int8 codes (one byte per 4-bit "
                f"weight) for the torch kernels, so the in-memory weights are about twice the "
                f"4-bit size{on_disk}; GPUs keep them packed"
            )
        if result.get("quantization"):
            result["notes"].append(
                f"{job.label}: the CPU has no int4 (or int8) matmul here: each quantized layer "
                "is dequantized to float before its matmul, so its speed rows show that extra "
                "work, not a speed-up; the speed-up needs a GPU kernel (BENCHMARKS.md)"
            )
    out = out or ResultFile(None)
    out.save(result)
    progress(
        f"ready in {startup_s:.1f} s: weights {result['weights_gib']:.3f} GiB, "
        f"KV {result['kv_cache_gib']:.3f} GiB = {report.kv_token_capacity:,} tokens"
    )

    vocab = engine.model_config.text_config.vocab_size
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    # Same seed in every worker: every configuration sees the same prompt ids.
    rng = random.Random(job.seed)
    llm.generate(
        _prompts(rng, 2, 16, vocab),
        SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )

    n_ttft = _ttft_runs(job.iters)
    if out.has("ttft_ms"):
        result["ttft_ms"] = out.previous["ttft_ms"]
        result["ttft_ms_runs"] = out.previous.get("ttft_ms_runs", [])
        progress("TTFT: kept from the previous run (--resume)")
    else:
        progress(f"TTFT: prompt {job.prompt_len} tokens, batch 1, {n_ttft} runs")
        ttfts = []
        phase = f"TTFT, prompt {job.prompt_len}"
        for i in range(n_ttft + 1):  # the first run is a warm-up
            bar(i, n_ttft + 1, phase)
            res = llm.generate(_prompts(rng, 1, job.prompt_len, vocab), greedy1, use_tqdm=False)
            m = res[0].metrics
            if i > 0:
                ttfts.append((m.first_token_time - m.arrival_time) * 1e3)
        bar(n_ttft + 1, n_ttft + 1, phase)
        result["ttft_ms"] = _median(ttfts)
        result["ttft_ms_runs"] = ttfts
        out.save(result)

    decode: dict[str, Any] = {}
    result["decode"] = decode
    result["decode_tok_s"] = {}
    for k, bs in enumerate(job.batch_sizes):
        if out.has("decode", str(bs)):
            decode[str(bs)] = out.previous["decode"][str(bs)]
            result["decode_tok_s"][str(bs)] = decode[str(bs)]["tok_s"]
            progress(f"decode batch {bs}: kept from the previous run (--resume)")
            continue
        progress(
            f"decode batch {bs} ({k + 1}/{len(job.batch_sizes)}): prompt "
            f"{job.prompt_len}, output {job.output_len}"
        )
        phase = f"decode, batch {bs}"
        bar(0, job.iters + 1, phase)
        _decode_rate(engine, _prompts(rng, bs, job.prompt_len, vocab), min(4, job.output_len))
        runs = []
        for i in range(job.iters):
            bar(i + 1, job.iters + 1, phase)
            runs.append(
                _decode_rate(engine, _prompts(rng, bs, job.prompt_len, vocab), job.output_len)
            )
        bar(job.iters + 1, job.iters + 1, phase)
        decode[str(bs)] = {
            "tok_s": _median([r["tok_s"] for r in runs]),
            "runs": runs,
            "preemptions": sum(r["preemptions"] for r in runs),
        }
        if decode[str(bs)]["preemptions"]:
            result["notes"].append(
                f"decode batch {bs}: {decode[str(bs)]['preemptions']} preemption(s) (the KV "
                "cache is too small for this batch; the figure includes recomputation)"
            )
        result["decode_tok_s"][str(bs)] = decode[str(bs)]["tok_s"]
        out.save(result)

    if job.throughput_requests > 0 and out.has("throughput"):
        result["throughput"] = out.previous["throughput"]
        result["throughput_tok_s"] = out.previous.get("throughput_tok_s")
        progress("throughput: kept from the previous run (--resume)")
    elif job.throughput_requests > 0:
        lo, hi, lo_out, hi_out = standard_workload_lengths(job.max_model_len)
        wl = random_workload(256, lo, hi, lo_out, hi_out, vocab, seed=0)
        n = job.throughput_requests
        prompts, outs = wl.prompts[:n], wl.output_lens[:n]
        progress(f"throughput: {n} requests, prompt/output lengths uniform in [{lo}, {hi}]")
        params = [
            SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=i, detokenize=False)
            for i, o in enumerate(outs)
        ]
        engine.core.kv_cache_manager.reset_prefix_cache()
        preempt0 = engine.core.num_preemptions
        phase = f"throughput, {n} requests"
        bar(0, n, phase)
        t = time.perf_counter()
        res = _generate_counting(llm, prompts, params, phase)
        elapsed = time.perf_counter() - t
        produced = sum(len(o.outputs[0].token_ids) for o in res)
        prompt_tokens = sum(len(p) for p in prompts)
        result["throughput"] = {
            "num_requests": n,
            "prompt_len_range": [lo, hi],
            "output_len_range": [lo_out, hi_out],
            "prompt_tokens": prompt_tokens,
            "output_tokens": produced,
            "elapsed_s": elapsed,
            "output_tok_s": produced / elapsed,
            "total_tok_s": (produced + prompt_tokens) / elapsed,
            "preemptions": engine.core.num_preemptions - preempt0,
        }
        result["throughput_tok_s"] = produced / elapsed
        out.save(result)

    # Serving peaks are read before the perplexity pass, whose full-window logits are not
    # part of serving.
    result.update(_peak_memory(device))
    result["load_average_end"] = os.getloadavg()
    result["torch_threads"] = torch.get_num_threads()

    if out.has("perplexity"):
        result["perplexity"] = out.previous["perplexity"]
        result["ppl"] = out.previous.get("ppl")
    else:
        result["perplexity"] = _pagoda_perplexity(job, llm, device)
        result["ppl"] = result["perplexity"]["ppl"]
        out.save(result)
    if out.has("greedy"):
        result["greedy"] = out.previous["greedy"]
    else:
        result["greedy"] = _greedy_answers(llm)
    out.save(result, complete=True)
    return result


def _greedy_answers(llm: Any) -> dict[str, Any] | None:
    """The greedy answers to `GREEDY_QUESTIONS` (chat template), as token ids: the parent
    compares them with the reference configuration's."""
    from pagoda.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        return None
    progress(f"greedy answers: {len(GREEDY_QUESTIONS)} questions, {GREEDY_MAX_TOKENS} tokens")
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS)
    if getattr(tokenizer, "chat_template", None):
        chats = [[{"role": "user", "content": q}] for q in GREEDY_QUESTIONS]
        outs = [r.outputs[0] for r in llm.chat(chats, params, use_tqdm=False)]
    else:  # a base model: the questions as plain prompts
        outs = [r.outputs[0] for r in llm.generate(list(GREEDY_QUESTIONS), params, use_tqdm=False)]
    return {
        "max_tokens": GREEDY_MAX_TOKENS,
        "questions": list(GREEDY_QUESTIONS),
        "token_ids": [list(o.token_ids) for o in outs],
        "texts": [o.text for o in outs],
    }


def _generate_counting(llm: Any, prompts: list, params: list, phase: str) -> list:
    """`llm.generate`, with a progress line per finished request (the parent's bar)."""
    engine = llm.llm_engine
    ids = []
    for p, sp in zip(prompts, params, strict=True):
        rid = engine.next_request_id()
        engine.add_request(rid, p, sp, final_only=True)
        ids.append(rid)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
                bar(len(done), len(ids), phase)
    return [done[i] for i in ids]


def _pagoda_perplexity(job: CompareJob, llm: Any, device: Any) -> dict[str, Any]:
    """Perplexity through the engine's own model (quantized layers included), computed by the
    quantizer's `pagoda.bench.perplexity`: the same tokens and windows as `pagoda eval
    perplexity MODEL --text FILE --window W`, so the two commands give the same number."""
    from pagoda.bench.perplexity import perplexity_of_model, windows

    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        return {"ppl": None, "skipped": "the model has no tokenizer (a bare config)"}
    text = Path(job.ppl_text).read_text(encoding="utf-8") if job.ppl_text else default_ppl_text()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < 2:
        raise ValueError(f"{job.ppl_text}: fewer than 2 tokens of text")
    window = min(job.ppl_window, job.max_model_len)
    spans = windows(len(ids), window, window)
    progress(f"perplexity: {len(ids)} tokens in {len(spans)} window(s) of {window}")
    bar(0, 1, f"perplexity, {len(spans)} window(s)")
    model = llm.llm_engine.core.runner.model
    nll, count = perplexity_of_model(model, ids, window, window, device)
    # The same digest as `pagoda eval perplexity`: equal <=> same tokens and windows.
    digest = hashlib.sha256(json.dumps([ids, window, window]).encode()).hexdigest()[:16]
    return {
        "ppl": math.exp(nll),
        "nll_per_token": nll,
        "tokens": count,
        "windows": len(spans),
        "window": window,
        "stride": window,
        "text_tokens": len(ids),
        "tokens_sha256": digest,
        "text": str(job.ppl_text) if job.ppl_text else DEFAULT_PPL_TEXT_NAME,
        "method": "pagoda.bench.perplexity.perplexity_of_model",
    }


# ---------------------------------------------------------------------- transformers


def run_transformers(job: CompareJob) -> dict[str, Any]:
    """transformers on random weights of the same shape and dtype (no quantization)."""
    import torch

    from pagoda.bench.common import environment, hf_model_from_config
    from pagoda.engine.args import EngineArgs
    from pagoda.model_files import transformers_config

    progress("building the transformers model")
    _, mc, _, _, runner_config = EngineArgs(
        model=job.model, dtype=job.dtype, device=job.device, max_model_len=job.max_model_len
    ).create_configs()
    device = torch.device(runner_config.device)
    hf_config = copy.deepcopy(transformers_config(mc.hf_config))  # a ConfigView is read-only
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # the baseline is the unquantized shape
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    model = hf_model_from_config(hf_config, getattr(torch, mc.dtype), device)
    build_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        weights = torch.cuda.memory_allocated(device) - before
    else:
        weights = sum(
            t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
        )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    vocab = mc.text_config.vocab_size
    rng = random.Random(job.seed)

    def gen(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    result: dict[str, Any] = {
        "label": job.label,
        "engine": "transformers",
        "model": job.model,
        "model_name": Path(mc.model).stem,
        "dtype": mc.dtype,
        "device": str(device),
        "env": environment(device),
        "weights_gib": weights / GiB,
        "build_s": build_s,
        "notes": [
            "transformers: random weights of the same shape and dtype, "
            "`generate` with a static batch (decode tok/s = B x (output-1) / "
            "(t(output) - t(1)))"
        ],
    }
    gen(_prompts(rng, 1, 16, vocab), 4)  # warm-up
    n_ttft = _ttft_runs(job.iters)
    progress(f"TTFT: prompt {job.prompt_len} tokens, batch 1, {n_ttft} runs")
    ttfts = [gen(_prompts(rng, 1, job.prompt_len, vocab), 1) * 1e3 for _ in range(n_ttft)]
    result["ttft_ms"] = _median(ttfts)
    result["ttft_ms_runs"] = ttfts
    decode: dict[str, Any] = {}
    for k, bs in enumerate(job.batch_sizes):
        progress(
            f"decode batch {bs} ({k + 1}/{len(job.batch_sizes)}): prompt "
            f"{job.prompt_len}, output {job.output_len}"
        )
        rates = []
        for _ in range(job.iters):
            prompts = _prompts(rng, bs, job.prompt_len, vocab)
            t1 = gen(prompts, 1)
            tn = gen(prompts, job.output_len)
            rates.append(bs * (job.output_len - 1) / (tn - t1) if tn > t1 else float("nan"))
        decode[str(bs)] = {"tok_s": _median(rates), "runs": rates}
    result["decode"] = decode
    result["decode_tok_s"] = {b: d["tok_s"] for b, d in decode.items()}
    result.update(_peak_memory(device))
    result["load_average_end"] = os.getloadavg()
    result["torch_threads"] = torch.get_num_threads()
    return result


# ---------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="JSON file with the CompareJob fields")
    p.add_argument("--out", required=True, help="where to write the JSON result")
    p.add_argument("--resume", action="store_true", help="keep the measurements --out has")
    ns = p.parse_args(argv)
    job = CompareJob.from_dict(json.loads(Path(ns.job).read_text(encoding="utf-8")))
    previous = None
    if ns.resume and Path(ns.out).is_file():
        with contextlib.suppress(json.JSONDecodeError):
            previous = json.loads(Path(ns.out).read_text(encoding="utf-8"))
    out = ResultFile(Path(ns.out), previous)
    import torch

    if job.cpu_threads:
        torch.set_num_threads(job.cpu_threads)
    try:
        if job.engine == "transformers":
            out.save(run_transformers(job), complete=True)
        else:
            run_pagoda(job, out)
    except Exception as e:  # reported to the parent as one line; the log keeps the traceback
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        print(f"{ERROR_PREFIX}{msg}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

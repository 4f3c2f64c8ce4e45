"""Structured-output overhead: batch JSON-schema decoding vs unconstrained, in one run.

Part 1 decodes `--batch` requests of `--output-len` tokens with the same engine, `--repeats`
times in pairs: without a constraint, then each under a JSON schema whose output cannot end
before `--output-len` (a long array of objects, compact whitespace), so both runs keep the whole
batch busy; it reports the median pair's decode tok/s and the median of the pairs' ratios.
Part 2 measures whether compiling grammars stalls other requests: `--batch` unconstrained
requests decode while `--compile-requests` requests with new (uncached) schemas arrive; it
reports the running requests' step gaps before and while the grammars compile, the same with the
new requests unconstrained (the control: admitting any request costs a mixed prefill step), and
how long one such compile takes when done on the calling thread instead.

    python benchmarks/structured/bench_structured.py --out DIR      # Qwen2.5-3B shape
    python benchmarks/structured/bench_structured.py --device cpu --dtype float32 \\
        --model config:benchmarks/structured/tiny-qwen2.json --batch 4 --output-len 16 \\
        --out DIR                                                   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.sampling_params import StructuredOutputsParams  # noqa: E402


def long_schema(tag: str = "items", num_fields: int = 3) -> dict:
    """An object holding an array of at least 1000 records: never complete within the run."""
    fields = {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"},
    }
    for i in range(num_fields - 3):
        fields[f"{tag}_f{i}"] = {"type": "string", "pattern": f"^[a-z]{{1,8}}-{i}$"}
    record = {"type": "object", "properties": fields, "required": list(fields)}
    return {
        "type": "object",
        "properties": {tag: {"type": "array", "items": record, "minItems": 1000}},
        "required": [tag],
    }


def decode_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Add every request, step until done; decode tok/s from the step where all have a token."""
    engine = llm.llm_engine
    ids = []
    for p, sp in zip(prompts, params, strict=True):
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
        ids.append(rid)
    counts = dict.fromkeys(ids, 0)
    t_all_started = None
    tokens_at_start = 0
    steps = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        steps.append(now)
        if t_all_started is None and all(counts.values()):
            t_all_started, tokens_at_start = now, sum(counts.values())
    t_end = time.perf_counter()
    total = sum(counts.values())
    decode_tokens = total - tokens_at_start
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return {
        "requests": len(ids),
        "output_tokens": total,
        "wall_s": t_end - t0,
        "decode_tokens": decode_tokens,
        "decode_s": t_end - t_all_started,
        "decode_tok_s": decode_tokens / (t_end - t_all_started),
        "median_step_ms": 1e3 * statistics.median(gaps) if gaps else None,
    }


def stall_run(
    llm: LLM, ns: argparse.Namespace, prompts: list[list[int]], with_grammar: bool = True
) -> dict:
    """Running requests' step gaps while new schemas compile on the grammar pool, until each
    new request has its first token; `with_grammar=False` is the control: the same requests
    without a constraint (what admitting them costs anyway: their prefill, a mixed step)."""
    engine = llm.llm_engine
    free = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    running = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": p}, free)
        running.append(rid)
    running_set = set(running)
    last_token: dict[str, float] = {}
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    compiling: dict[str, float] = {}
    compile_latency: list[float] = []
    mgr = engine.structured_output_manager()
    compiles_before = mgr.num_compiles
    step = 0
    while engine.has_unfinished_requests():
        if step == ns.warmup_steps:
            for i in range(ns.compile_requests):
                so = StructuredOutputsParams(
                    json=long_schema(f"new{i}_{time.time_ns()}", ns.schema_fields),
                    disable_any_whitespace=True,
                )
                sp = SamplingParams(
                    temperature=0, max_tokens=8, structured_outputs=so if with_grammar else None
                )
                rid = engine.next_request_id()
                compiling[rid] = time.perf_counter()
                engine.add_request(rid, {"prompt_token_ids": prompts[0]}, sp)
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid in compiling and out.outputs[0].token_ids:
                compile_latency.append(now - compiling.pop(rid))  # compile + first step
            if rid not in running_set:
                continue
            if rid in last_token:
                gap = now - last_token[rid]
                if step < ns.warmup_steps:
                    gaps_before.append(gap)
                elif compiling or step == ns.warmup_steps:
                    gaps_during.append(gap)
            last_token[rid] = now
        step += 1
    compiled = mgr.num_compiles - compiles_before
    sync_compile_s = None
    if with_grammar:
        # The counterfactual: the same compile on the engine thread would stall it this long.
        t = time.perf_counter()
        so = StructuredOutputsParams(
            json=long_schema(f"sync_{time.time_ns()}", ns.schema_fields),
            disable_any_whitespace=True,
        )
        mgr._compile(mgr.grammar(so))
        sync_compile_s = time.perf_counter() - t
    return {
        "running_requests": len(running),
        "compile_requests": ns.compile_requests,
        "grammars_compiled": compiled,
        "median_gap_before_ms": 1e3 * statistics.median(gaps_before) if gaps_before else None,
        "median_gap_during_ms": 1e3 * statistics.median(gaps_during) if gaps_during else None,
        "max_gap_during_ms": 1e3 * max(gaps_during) if gaps_during else None,
        "max_gap_before_ms": 1e3 * max(gaps_before) if gaps_before else None,
        "gaps_during_compile": len(gaps_during),
        "admit_latency_ms": [1e3 * x for x in compile_latency],
        "one_compile_on_engine_thread_ms": 1e3 * sync_compile_s if sync_compile_s else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=f"config:{ROOT}/benchmarks/configs/qwen2.5-3b.json")
    p.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/qwen2.5-tokenizer"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--compile-requests", type=int, default=4)
    p.add_argument("--schema-fields", type=int, default=40, help="fields per record (part 2)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="unconstrained / JSON pairs (median)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", required=True, help="directory for structured.json")
    ns = p.parse_args()
    if ns.repeats < 1:
        p.error(f"--repeats must be >= 1, got {ns.repeats}")

    llm = LLM(
        ns.model,
        tokenizer=ns.tokenizer,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.prompt_len + ns.output_len + 64,
        max_num_seqs=max(ns.batch, 8) + ns.compile_requests,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enforce_eager=ns.enforce_eager,
        print_memory_report=False,
    )
    vocab = llm.llm_engine.model_config.text_config.vocab_size
    prompts = [
        [(1000 + 7919 * (i * ns.prompt_len + j)) % min(vocab, 150000) for j in range(ns.prompt_len)]
        for i in range(ns.batch)
    ]
    free = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    schema = StructuredOutputsParams(json=long_schema(), disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=ns.output_len, structured_outputs=schema)

    # Warm-up: CUDA graphs, allocator, the grammar compiler's tokenizer tables, this schema.
    decode_run(llm, prompts[:2], [free.clone() for _ in range(2)])
    decode_run(llm, prompts[:2], [constrained.clone() for _ in range(2)])

    result: dict = {
        "model": ns.model,
        "batch": ns.batch,
        "prompt_len": ns.prompt_len,
        "output_len": ns.output_len,
        "async_scheduling": llm.llm_engine.core.async_scheduling,
        "device": str(llm.llm_engine.core.runner.device),
    }
    # Alternating pairs; the ratio reported is the median of the pairs' ratios (one pair
    # lasts ~2 s on an H200, short enough for host noise to move a single ratio by 10 %).
    pairs = []
    for _ in range(ns.repeats):
        u = decode_run(llm, prompts, [free.clone() for _ in prompts])
        c = decode_run(llm, prompts, [constrained.clone() for _ in prompts])
        pairs.append((u, c, c["decode_tok_s"] / u["decode_tok_s"]))
    ratios = [r for _, _, r in pairs]
    u, c, _ = sorted(pairs, key=lambda p: p[2])[len(pairs) // 2]
    result["unconstrained"], result["json_schema"] = u, c
    result["json_schema_over_unconstrained"] = statistics.median(ratios)
    result["pair_ratios"] = ratios
    result["stall_control"] = stall_run(llm, ns, prompts, with_grammar=False)
    result["stall"] = stall_run(llm, ns, prompts)

    os.makedirs(ns.out, exist_ok=True)
    path = Path(ns.out) / "structured.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    u, c = result["unconstrained"], result["json_schema"]
    s, c0 = result["stall"], result["stall_control"]

    def ms(v: float | None) -> str:  # None: no step fell in that window (a short run)
        return "n/a" if v is None else f"{v:.2f} ms"

    print(
        f"decode tok/s: unconstrained {u['decode_tok_s']:.0f}, json_schema "
        f"{c['decode_tok_s']:.0f} ({result['json_schema_over_unconstrained']:.3f}x, median of "
        f"{', '.join(f'{r:.3f}' for r in result['pair_ratios'])}); "
        f"step gap median {ms(s['median_gap_before_ms'])} before, "
        f"{ms(s['median_gap_during_ms'])} (max {ms(s['max_gap_during_ms'])}) while "
        f"{s['grammars_compiled']} grammars compiled; admitting the same requests without a "
        f"grammar: median {ms(c0['median_gap_during_ms'])}, max "
        f"{ms(c0['max_gap_during_ms'])}; one compile on the engine thread "
        f"{ms(s['one_compile_on_engine_thread_ms'])} -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

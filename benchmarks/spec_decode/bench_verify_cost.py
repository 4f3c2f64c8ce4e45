"""Speculative decoding on the GPU: verification cost and a known-acceptance end-to-end run.

1. Cost of a verify step (query length 1 + k per sequence, k = 0..8) relative to a plain decode
   step, at several batch sizes, on random weights of a real shape (`config:...json[:w4a16]`):
   the engine's own step (`ModelRunner.launch` + rejection sampling: eager for k >= 1, the
   captured decode graph for k = 0), and the same forward replayed from a CUDA graph captured
   here for each query length (what verification costs once it runs in graphs).
2. End to end, labelled as such: a proposer that replays the target's own greedy continuation
   with each draft token corrupted at a set rate (known acceptance), against plain decoding on
   a separate engine with the default (async) loop. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import SamplingParams as SP
from pagoda.step import ScheduledRequest, SchedulerOutput


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, iters: int) -> float:
    fn()
    fn()
    _sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def verify_costs(llm: LLM, batches: list[int], ks: list[int], ctx: int, iters: int) -> list[dict]:
    runner = llm.llm_engine.core.runner
    bs = runner.block_size
    greedy = SP(temperature=0.0, max_tokens=1000)
    rows = []
    for batch in batches:
        blocks_per_seq = -(-(ctx + 9) // bs)
        if 1 + batch * blocks_per_seq > llm.llm_engine.core.kv_cache_manager.num_free_blocks:
            print(f"batch {batch}: KV cache too small, skipped", flush=True)
            continue
        block_ids = [
            list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)
        ]
        rng = random.Random(batch)
        tokens = [[rng.randrange(100, 10000) for _ in range(ctx + 9)] for _ in range(batch)]
        base = None
        for k in ks:
            reqs = [
                ScheduledRequest(
                    req_id=f"b{batch}k{k}r{i}",
                    all_token_ids=tokens[i][: ctx + 1],
                    num_computed_tokens=ctx,
                    num_new_tokens=1 + k,
                    block_ids=block_ids[i],
                    sampling_params=greedy,
                    prompt_len=ctx,
                    output_token_ids=[],
                    do_sample=True,
                    spec_token_ids=tokens[i][ctx + 1 : ctx + 1 + k],
                )
                for i in range(batch)
            ]
            sched = SchedulerOutput(reqs, batch * (1 + k))
            step = _time(lambda sched=sched: runner.launch(sched).result(), iters)
            if PROFILE_LAUNCH[0] and batch == 1 and k == max(ks):
                _profile_launch(runner, sched)
            graph = _graph_forward_time(runner, reqs, ctx, k, iters)
            if base is None:
                base = step
            row = dict(
                batch=batch,
                k=k,
                engine_step_s=step,
                engine_step_ratio=step / base,
                graph_forward_s=graph,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        g0 = next(r["graph_forward_s"] for r in rows if r["batch"] == batch and r["k"] == 0)
        for r in rows:
            if r["batch"] == batch and r["graph_forward_s"] is not None and g0:
                r["graph_forward_ratio"] = r["graph_forward_s"] / g0
    return rows


_GRAPHS_OK = [True]
PROFILE_LAUNCH = [False]
PROFILE_HOST: list = [None]  # (batch, corruption) of the e2e run to cProfile


def _profile_launch(runner, sched) -> None:
    """Host and device time of the engine's own step (`runner.launch`), by op: where a verify
    step's time goes beyond its forward."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            runner.launch(sched).result()
        _sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


def _graph_forward_time(runner, reqs, ctx: int, k: int, iters: int) -> float | None:
    """Forward + LM head of all 1 + k rows per sequence, replayed from a CUDA graph captured
    for this exact step (fixed lengths): the cost verification has once it runs in graphs."""
    if not torch.cuda.is_available() or not _GRAPHS_OK[0]:
        return None
    n = len(reqs)
    num_new = [1 + k] * n
    num_tokens = n * (1 + k)
    arrays = runner._prepare_arrays([ctx] * n, num_new, [r.block_ids for r in reqs], num_tokens)
    md = runner._build_metadata([ctx] * n, num_new, [], num_tokens, arrays)
    md.uniform_query_len = True  # as the engine's verify graphs: the fused attention may run
    ids = torch.zeros(num_tokens, dtype=torch.long, device=runner.device)
    pos = torch.from_numpy(arrays["positions"]).to(runner.device)
    model = runner.model

    def fwd():
        return model.compute_logits(model(ids, pos, md))

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            fwd()
            fwd()
        torch.cuda.current_stream().wait_stream(s)
        _sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            fwd()
        t = _time(graph.replay, iters)
        del graph
        return t
    except Exception as e:  # a kernel that cannot be captured: report, do not hide
        print(f"graph capture failed for k={k}: {e!r}; no more captures", flush=True)
        _GRAPHS_OK[0] = False
        return None


def kernel_profile(runner, ctx: int, ks: list[int], batch: int, top: int = 25) -> dict:
    """GPU time per kernel name of one eager forward + LM head at query length 1 + k (batch
    `batch`), for each k: where verification's extra time goes (kernel times are those a
    graph replays; the launch gaps are not counted)."""
    from torch.profiler import ProfilerActivity, profile

    bs = runner.block_size
    blocks = -(-(ctx + 9) // bs)
    block_ids = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
    out = {}
    for k in ks:
        num_new = [1 + k] * batch
        n = batch * (1 + k)
        arrays = runner._prepare_arrays([ctx] * batch, num_new, block_ids, n)
        md = runner._build_metadata([ctx] * batch, num_new, [], n, arrays)
        md.uniform_query_len = True  # as the engine's verify graphs
        ids = torch.zeros(n, dtype=torch.long, device=runner.device)
        pos = torch.from_numpy(arrays["positions"]).to(runner.device)
        with torch.inference_mode():
            for _ in range(3):
                runner.model.compute_logits(runner.model(ids, pos, md))
            _sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner.model.compute_logits(runner.model(ids, pos, md))
                _sync()
        per: dict[str, list] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                d = per.setdefault(ev.name[:90], [0.0, 0])
                d[0] += ev.device_time / 5
                d[1] += 1
        rows = sorted(per.items(), key=lambda kv: -kv[1][0])
        out[str(k)] = dict(
            total_us=sum(v[0] for v in per.values()),
            kernels=[dict(name=n, us=round(v[0], 1), calls=v[1] // 5) for n, v in rows[:top]],
        )
        print(
            f"profile batch {batch} k={k}: {out[str(k)]['total_us']:.0f} us of kernels", flush=True
        )
        for r in out[str(k)]["kernels"][:12]:
            print(f"  {r['us']:9.1f} us {r['calls']:4d}x {r['name']}", flush=True)
    return out


class ReplayProposer:
    """Drafts = the target's own greedy continuation from here, each token replaced by another
    with probability `corruption`: a proposer of known acceptance (benchmark only)."""

    KEY = 32  # prompts are told apart by their first tokens

    def __init__(self, k: int, reference: dict[tuple, list[int]], corruption: float, seed: int):
        self.k = k
        # first KEY prompt tokens -> (prompt length, greedy continuation)
        self.reference = {p[: self.KEY]: (len(p), c) for p, c in reference.items()}
        self.corruption = corruption
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], k: int | None = None, state=None) -> list[int]:
        k = self.k if k is None else k
        hit = self.reference.get(tuple(token_ids[: self.KEY]))
        if hit is None:
            return []
        n, cont = hit
        done = len(token_ids) - n
        out = cont[done : done + k]
        return [t if self.rng.random() >= self.corruption else (t + 1) % 10000 for t in out]


def host_profile(spec: LLM, prompts: list, params: SamplingParams, top: int = 30) -> str:
    """cProfile of one speculative generate: where the in-order loop's host time goes (the
    event wait in `PendingOutput.result` is the device's share)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    spec.generate(prompts, params, use_tqdm=False)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return buf.getvalue()


def end_to_end(
    model: str,
    batches: list[int],
    k: int,
    corruptions: list[float],
    prompt_len: int,
    output_len: int,
    max_model_len: int,
) -> list[dict]:
    common = dict(
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        max_num_seqs=max(batches),
        print_memory_report=False,
    )
    # each engine's budget counts the earlier ones' memory as in use: 0.3 + 0.3 + 0.3
    plain = LLM(model, gpu_memory_utilization=0.3, **common)
    cfg = {"method": "ngram", "num_speculative_tokens": k}
    # every step speculates (what the drafts' acceptance gives), and the default: speculate
    # where it measures faster (spec_governor.py), which must never be much below plain
    fixed = LLM(model, speculative_config=dict(cfg, adaptive=False), gpu_memory_utilization=0.6,
                **common)  # fmt: skip
    adaptive = LLM(model, speculative_config=cfg, gpu_memory_utilization=0.9, **common)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows = []
    for batch in batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(100, 10000) for _ in range(prompt_len)] for _ in range(batch)]
        plain.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        ref, t_plain, d_plain = _timed_generate(plain, prompts, params)
        reference = {tuple(p): r.outputs[0].token_ids for p, r in zip(prompts, ref, strict=True)}
        for c in corruptions:
            row = dict(batch=batch, k=k, corruption=c, plain_s=t_plain, plain_decode_s=d_plain)
            for name, spec in (("fixed", fixed), ("adaptive", adaptive)):
                core = spec.llm_engine.core
                spec.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)

                def fresh(core=core, seed=batch, reference=reference, c=c):
                    core.proposer = ReplayProposer(k, reference, c, seed=seed)
                    if core.governor is not None:  # as a fresh engine: nothing measured yet
                        core.governor = type(core.governor)(shadows=core.governor.shadows)

                out, t_spec, d_spec = _timed_generate(spec, prompts, params, fresh)
                same = all(
                    a.outputs[0].token_ids == b.outputs[0].token_ids
                    for a, b in zip(ref, out, strict=True)
                )
                steps = sum(o.metrics.spec_num_steps for o in out)
                acc = sum(o.metrics.spec_num_accepted_tokens for o in out)
                suffix = "" if name == "fixed" else "_adaptive"
                row.update(
                    {
                        f"spec_s{suffix}": t_spec,
                        f"speedup{suffix}": t_plain / t_spec,
                        f"spec_decode_s{suffix}": d_spec,
                        f"decode_speedup{suffix}": d_plain / d_spec,
                        f"mean_accepted_length{suffix}": 1 + acc / steps if steps else None,
                        f"spec_steps{suffix}": steps,
                        f"greedy_identical{suffix}": same,
                    }
                )
                if name == "fixed" and PROFILE_HOST[0] == (batch, c):
                    fresh()
                    core.kv_cache_manager.reset_prefix_cache()
                    print(f"host profile, batch {batch}, corruption {c}:", flush=True)
                    print(host_profile(spec, prompts, params), flush=True)
                    if c == corruptions[0]:  # the plain engine's loop beside it, once
                        plain.llm_engine.core.kv_cache_manager.reset_prefix_cache()
                        print(f"host profile, batch {batch}, plain:", flush=True)
                        print(host_profile(plain, prompts, params), flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
        plain.llm_engine.core.kv_cache_manager.reset_prefix_cache()
    return rows


def _timed_generate(llm: LLM, prompts, params, before=None, repeats: int = 2):
    """(outputs, best total seconds, best decode-phase seconds) over `repeats` runs, each from
    an empty prefix cache (`before()` resets what else a run changes). The decode phase runs
    from the last request's first token to the last one's finish (prefill excluded)."""
    best_total = best_decode = float("inf")
    out = None
    for _ in range(repeats):
        if before is not None:
            before()
        llm.llm_engine.core.kv_cache_manager.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        best_total = min(best_total, time.perf_counter() - t)
        first = max(o.metrics.first_token_time for o in out)
        best_decode = min(best_decode, max(o.metrics.finished_time for o in out) - first)
    return out, best_total, best_decode


def draft_cost(
    model: str, drafts: list[str], batches: list[int], k: int, prompt_len: int, output_len: int,
    max_model_len: int, method: str = "draft_model",
) -> list[dict]:  # fmt: skip
    """Wall time of a speculating step with a draft model or EAGLE head (`method`; random
    weights: the drafts are rejected, so every step runs the draft k + 1 times — the head: once
    over the step's 1 + k rows and k - 1 chained times — and verifies; the accepted length is
    what real weights give, measured on the CPU) against a plain decode step, per batch: both
    from the decode phase of the best of two runs (`_timed_generate`)."""
    common = dict(
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        max_num_seqs=max(batches),
        print_memory_report=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows = []
    plain = LLM(model, gpu_memory_utilization=0.3, **common)
    plain_step = {}
    for batch in batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(100, 10000) for _ in range(prompt_len)] for _ in range(batch)]
        plain.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        _, _, decode_s = _timed_generate(plain, prompts, params)
        plain_step[batch] = decode_s / (output_len - 1)  # the first token is the prefill's
    plain.shutdown()
    del plain
    for draft in drafts:
        spec = LLM(
            model,
            speculative_config={
                "method": method,
                "model": draft,
                "num_speculative_tokens": k,
                "adaptive": False,
            },
            gpu_memory_utilization=0.6,
            **common,
        )
        for batch in batches:
            rng = random.Random(batch)
            prompts = [[rng.randrange(100, 10000) for _ in range(prompt_len)] for _ in range(batch)]
            spec.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
            out, _, t_spec = _timed_generate(spec, prompts, params)  # decode phase, best of 2
            steps = statistics.mean(o.metrics.spec_num_steps for o in out)
            acc = sum(o.metrics.spec_num_accepted_tokens for o in out)
            row = dict(
                batch=batch,
                k=k,
                method=method,
                draft=draft,
                plain_step_s=plain_step[batch],
                spec_step_s=t_spec / steps if steps else None,
                spec_step_ratio=t_spec / steps / plain_step[batch] if steps else None,
                mean_accepted_length=1 + acc / sum(o.metrics.spec_num_steps for o in out),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        spec.shutdown()
        del spec
    return rows


def random_eagle_head(model: str, out: Path) -> str:
    """`config:` of an EAGLE head for a `config:FILE.json[:suffix]` target: its decoder layer
    (one, unquantized), random weights. Written to `out`."""
    if not model.startswith("config:"):
        raise SystemExit("--eagle-heads random needs a config:FILE.json target")
    spec = model.removeprefix("config:")
    base, _, suffix = spec.rpartition(":")
    path = Path(base if base and not suffix.endswith(".json") else spec)
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg["num_hidden_layers"] = 1
    head = out / f"eagle_head_{path.stem}.json"
    head.write_text(json.dumps(cfg, indent=1))
    return f"config:{head}"


def vl_end_to_end(
    model: str, k: int, corruptions: list[float], output_len: int, max_model_len: int = 4096
) -> list[dict]:
    """Qwen2.5-VL with an image (a 640x480 data-URL chat), batch 1: plain against speculating
    with the known-acceptance proposer; greedy tokens must be equal."""
    from pagoda.bench.edge import _chat

    tok = str(Path(__file__).resolve().parents[2] / "tests/fixtures/qwen2.5-tokenizer")
    common = dict(
        tokenizer=tok,
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=max_model_len,
        limit_mm_per_prompt={"image": 1},
        print_memory_report=False,
        # both engines prefill the whole prompt every time (a prefix-cache hit in one of them
        # would compute the prompt's tail with other kernel shapes than the other's prefill)
        enable_prefix_caching=False,
    )
    plain = LLM(model, gpu_memory_utilization=0.3, **common)
    spec = LLM(
        model,
        speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": False},
        gpu_memory_utilization=0.6,
        **common,
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    messages = _chat(640, 480, 0)
    plain.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    (ref,) = plain.chat(messages, params, use_tqdm=False)
    t_plain = time.perf_counter() - t
    reference = {tuple(ref.prompt_token_ids): ref.outputs[0].token_ids}
    rows = []
    for c in corruptions:
        core = spec.llm_engine.core
        core.proposer = ReplayProposer(k, reference, c, seed=1)
        core.kv_cache_manager.reset_prefix_cache()
        t = time.perf_counter()
        (out,) = spec.chat(messages, params, use_tqdm=False)
        t_spec = time.perf_counter() - t
        m = out.metrics
        row = dict(
            model=model,
            batch=1,
            k=k,
            corruption=c,
            prompt_tokens=len(ref.prompt_token_ids),
            plain_s=t_plain,
            spec_s=t_spec,
            speedup=t_plain / t_spec,
            mean_accepted_length=(
                1 + m.spec_num_accepted_tokens / m.spec_num_steps if m.spec_num_steps else None
            ),
            greedy_identical=out.outputs[0].token_ids == ref.outputs[0].token_ids,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--ks", default="0,1,2,3,4,5,6,7,8")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--e2e-model", default=None, help="model of the known-acceptance run")
    p.add_argument("--e2e-batches", default="1,8,32")
    p.add_argument("--e2e-k", type=int, default=4)
    p.add_argument("--e2e-corruptions", default="0,0.2,0.5,1.0")
    p.add_argument("--e2e-output-len", type=int, default=128)
    p.add_argument("--profile-batches", default="", help="kernel time per name at these batches")
    p.add_argument("--profile-ks", default="0,1,4")
    p.add_argument("--skip-costs", action="store_true", help="profile only")
    p.add_argument("--profile-launch", action="store_true", help="op table of a batch-1 step")
    p.add_argument(
        "--profile-host",
        default="",
        help="B,C: cProfile the e2e speculative run at batch B, corruption C",
    )
    p.add_argument("--draft-models", nargs="*", default=[], help="draft-model step cost")
    p.add_argument(
        "--eagle-heads",
        nargs="*",
        default=[],
        help="EAGLE head step cost: head directories, or 'random' (the target's layer, one)",
    )
    p.add_argument("--eagle-ks", default="", help="k values of the EAGLE cost (default: e2e-k)")
    p.add_argument("--vl-model", default=None, help="Qwen2.5-VL known-acceptance run, an image")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    PROFILE_LAUNCH[0] = ns.profile_launch
    if ns.profile_host:
        b, c = ns.profile_host.split(",")
        PROFILE_HOST[0] = (int(b), float(c))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in ns.batches.split(",")]
    ks = [int(x) for x in ns.ks.split(",")]
    env = dict(
        commit=ns.commit,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    for model in ns.models:
        if ns.skip_costs and not ns.profile_batches:
            break  # nothing measured on this engine
        llm = LLM(
            model,
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
            max_model_len=ns.ctx + 64,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(batches) * 9 + 64,
            gpu_memory_utilization=0.5,
            skip_tokenizer_init=True,
            print_memory_report=False,
        )
        name = model.replace("config:benchmarks/configs/", "").replace("/", "_").replace(":", "_")
        if not ns.skip_costs:
            rows = verify_costs(llm, batches, ks, ns.ctx, ns.iters)
            (out / f"verify_{name}.json").write_text(
                json.dumps(dict(env, model=model, ctx=ns.ctx, rows=rows), indent=1)
            )
        if ns.profile_batches and torch.cuda.is_available():
            pks = [int(x) for x in ns.profile_ks.split(",")]
            prof = {
                b: kernel_profile(llm.llm_engine.core.runner, ns.ctx, pks, int(b))
                for b in ns.profile_batches.split(",")
            }
            (out / f"profile_{name}.json").write_text(
                json.dumps(dict(env, model=model, ctx=ns.ctx, batches=prof), indent=1)
            )
        llm.shutdown()
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if ns.vl_model:
        rows = vl_end_to_end(
            ns.vl_model, ns.e2e_k, [float(x) for x in ns.e2e_corruptions.split(",")],
            ns.e2e_output_len,
        )  # fmt: skip
        (out / "vl_known_acceptance.json").write_text(json.dumps(dict(env, rows=rows), indent=1))
    if ns.draft_models:
        rows = draft_cost(
            ns.e2e_model or ns.models[0],
            ns.draft_models,
            [int(x) for x in ns.e2e_batches.split(",")],
            ns.e2e_k,
            ns.ctx,
            ns.e2e_output_len,
            ns.ctx + ns.e2e_output_len + 64,
        )
        (out / "draft_cost.json").write_text(
            json.dumps(dict(env, model=ns.e2e_model or ns.models[0], rows=rows), indent=1)
        )
    if ns.eagle_heads:
        model = ns.e2e_model or ns.models[0]
        heads = [random_eagle_head(model, out) if h == "random" else h for h in ns.eagle_heads]
        rows = []
        for k in [int(x) for x in ns.eagle_ks.split(",")] if ns.eagle_ks else [ns.e2e_k]:
            rows += draft_cost(
                model,
                heads,
                [int(x) for x in ns.e2e_batches.split(",")],
                k,
                ns.ctx,
                ns.e2e_output_len,
                ns.ctx + ns.e2e_output_len + 64,
                method="eagle",
            )
        (out / "eagle_cost.json").write_text(
            json.dumps(dict(env, model=model, rows=rows), indent=1)
        )
    if ns.e2e_model:
        rows = end_to_end(
            ns.e2e_model,
            [int(x) for x in ns.e2e_batches.split(",")],
            ns.e2e_k,
            [float(x) for x in ns.e2e_corruptions.split(",")],
            ns.ctx,
            ns.e2e_output_len,
            ns.ctx + ns.e2e_output_len + 64,
        )
        (out / "e2e_known_acceptance.json").write_text(
            json.dumps(dict(env, model=ns.e2e_model, rows=rows), indent=1)
        )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

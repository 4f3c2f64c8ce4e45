"""Speculative decoding on real weights (CPU): acceptance per kind of prompt, and tok/s.

One target model answers chat, summarization/extraction and code prompts (those of
acceptance_cpu.py) greedily, one request at a time (batch 1): plainly, with n-gram drafts,
with a draft model (`--draft`) and with an EAGLE head (`--eagle`, e.g. one written by
train_eagle.py), each speculative method at every k of `--k` (a comma list). Per method and
kind it records the drafts proposed and accepted
(`RequestOutput.metrics`), giving the acceptance rate, the mean accepted length per verify step
(1 + accepted / steps) and the tokens per target decode step, plus end-to-end output tok/s;
speculative outputs are compared token for token with the plain ones. Engines run one after
the other (two fp32 models of a few GiB do not fit beside a third), so the machine's load
average is recorded with each timing. Writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from acceptance_cpu import PROMPTS

from pagoda import LLM, SamplingParams


def run(llm: LLM, params: SamplingParams) -> dict:
    """Every prompt of every kind, one at a time; outputs, timings and spec counters."""
    out = {}
    for kind, prompts in PROMPTS.items():
        llm.llm_engine.core.kv_cache_manager.reset_prefix_cache()
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = [
            llm.chat([[{"role": "user", "content": q}]], params, use_tqdm=False)[0] for q in prompts
        ]
        wall = time.perf_counter() - t0
        tokens = sum(len(r.outputs[0].token_ids) for r in res)
        drafted = sum(r.metrics.spec_num_draft_tokens for r in res)
        accepted = sum(r.metrics.spec_num_accepted_tokens for r in res)
        steps = sum(r.metrics.spec_num_steps for r in res)
        # Decode steps after the prefill's token: each emits 1 + its accepted drafts.
        decode_tokens = tokens - len(res)
        out[kind] = dict(
            output_tokens=tokens,
            wall_s=wall,
            tok_s=tokens / wall,
            load_avg_1m_before=load,
            verify_steps=steps,
            drafted=drafted,
            accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else None,
            mean_accepted_length=1 + accepted / steps if steps else None,
            tokens_per_decode_step=decode_tokens / (decode_tokens - accepted)
            if decode_tokens > accepted
            else None,
            token_ids=[r.outputs[0].token_ids for r in res],
            texts=[r.outputs[0].text[:200] for r in res],
        )
        print(
            kind,
            {k: v for k, v in out[kind].items() if k not in ("token_ids", "texts")},
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=None, help="target model (default: the embedded one)")
    p.add_argument("--draft", default=None, help="draft model sharing the target's tokenizer")
    p.add_argument("--eagle", default=None, help="EAGLE head directory trained for the target")
    p.add_argument("--methods", default="plain,ngram,draft")
    p.add_argument("--k", default="4", help="draft tokens per step: one k or a list (1,2,3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--assert-identical",
        action="store_true",
        help="exit 1 when a speculative greedy output differs from the plain one",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    ks = [int(k) for k in ns.k.split(",")]

    def configs(method: str, k: int) -> dict | None:
        return {
            "plain": None,
            "ngram": {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_max": 4,
                "adaptive": False,
            },
            "draft": {"model": ns.draft, "num_speculative_tokens": k, "adaptive": False},
            "eagle": {
                "method": "eagle",
                "model": ns.eagle,
                "num_speculative_tokens": k,
                "adaptive": False,
            },
        }[method]

    methods = ns.methods.split(",")
    if "draft" in methods and ns.draft is None:
        p.error("method 'draft' needs --draft")
    if "eagle" in methods and ns.eagle is None:
        p.error("method 'eagle' needs --eagle")
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    result: dict = dict(
        commit=ns.commit,
        date=time.strftime("%Y-%m-%d"),
        device="cpu",
        cpu_count=os.cpu_count(),
        torch_threads=int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
        target=ns.target or "embedded SmolLM2-135M-Instruct",
        draft=ns.draft,
        eagle=ns.eagle,
        k=ks,
        torch_num_threads=ns.threads or None,
        max_tokens=ns.max_tokens,
        methods={},
    )
    runs = [(m, k) for m in methods for k in ([ks[0]] if m == "plain" else ks)]
    for method, k in runs:
        name = method if method == "plain" or len(ks) == 1 else f"{method}@k{k}"
        t0 = time.perf_counter()
        llm = LLM(
            ns.target,
            max_model_len=ns.max_model_len,
            speculative_config=configs(method, k),
            print_memory_report=False,
        )
        load_s = time.perf_counter() - t0
        print(f"{name}: engine up in {load_s:.0f} s", flush=True)
        result["methods"][name] = dict(k=k, engine_start_s=load_s, kinds=run(llm, params))
        llm.shutdown()
        del llm
        gc.collect()
        compare(result["methods"])
        write(result, Path(ns.out))  # after every method: a long run keeps what it measured
    differ = [
        f"{name} {kind}"
        for name, entry in result["methods"].items()
        for kind, row in entry["kinds"].items()
        if row.get("greedy_identical") is False
    ]
    if differ:
        print("greedy outputs differ from plain:", ", ".join(differ), flush=True)
        if ns.assert_identical:
            raise SystemExit(1)


def compare(methods: dict) -> None:
    """Speculative rows against the plain ones: same tokens? how much faster?"""
    plain = methods.get("plain")
    if plain is None:
        return
    for method, entry in methods.items():
        if method == "plain":
            continue
        for kind, row in entry["kinds"].items():
            ref = plain["kinds"][kind]
            row["greedy_identical"] = row["token_ids"] == ref["token_ids"]
            row["speedup_vs_plain"] = row["tok_s"] / ref["tok_s"]


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("wrote", out, flush=True)


if __name__ == "__main__":
    main()

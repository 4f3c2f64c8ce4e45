"""Speculative decoding on real weights (CPU): acceptance by kind of prompt, and end-to-end speed.

The embedded SmolLM2-135M-Instruct (GGUF Q4_1) answers chat, summarization/extraction and code
prompts greedily with the n-gram proposer at k = 8. Every verify step's number of accepted
drafts is recorded, which gives the mean accepted length (tokens per target step) at k = 8 and,
derived as the same accepted prefixes cut at k, for k < 8. Then plain and speculative runs are
timed alternately (same prompts) and their outputs compared token for token. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagoda import LLM, SamplingParams
from pagoda.engine.scheduler import Scheduler

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, flows through Liechtenstein, Austria, "
    "Germany and France, and empties into the North Sea in the Netherlands. It is about 1,230 "
    "kilometres long. Major cities on the Rhine include Basel, Strasbourg, Cologne, Düsseldorf "
    "and Rotterdam. The river has been an important trade route since Roman times, and today "
    "barges carry coal, steel, grain and containers along it. Its middle section, the Rhine "
    "Gorge between Bingen and Koblenz, is a UNESCO World Heritage Site known for its castles "
    "and vineyards."
)
EMAIL = (
    "From: Maria Lopez <maria.lopez@example.com>\nTo: support@shop.example\nDate: 3 March 2025\n"
    "Subject: Order 48213 arrived damaged\n\nHello, my order number 48213 (two ceramic mugs and "
    "a teapot) arrived on 1 March with the teapot broken. I paid 42.50 EUR by card. Please send "
    "a replacement teapot to my address: Calle Mayor 12, 28013 Madrid, Spain. Thanks, Maria"
)
CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
"""

PROMPTS = {
    "chat": [
        "What are three tips for sleeping better?",
        "Explain what a black hole is to a ten-year-old.",
    ],
    "summarization_extraction": [
        f"Summarize this text in two sentences:\n\n{PASSAGE}",
        f"Extract the customer's name, email, order number, amount paid and address from this "
        f"email, as a list:\n\n{EMAIL}",
    ],
    "code": [
        f"Add type hints and docstrings to this Python code:\n\n```python\n{CODE}```",
        f"Rewrite `adults` in this code as a list comprehension and show the whole file:\n\n"
        f"```python\n{CODE}```",
    ],
}


def record_accepts() -> list[tuple[str, int, int]]:
    """Patch the scheduler to record (request id, drafts, accepted) of every verify step."""
    log: list[tuple[str, int, int]] = []
    original = Scheduler._update_spec

    def wrapped(self, request, sched, runner_output, chunk_logprobs):
        emitted = runner_output.spec_token_ids[sched.req_id]
        log.append((sched.req_id, len(sched.spec_token_ids), len(emitted) - 1))
        return original(self, request, sched, runner_output, chunk_logprobs)

    Scheduler._update_spec = wrapped
    return log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--timed-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    log = record_accepts()
    greedy = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    # every step speculates: the acceptance of the drafts themselves
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": ns.k,
        "prompt_lookup_max": 4,
        "adaptive": False,
    }
    result: dict = dict(
        commit=ns.commit, date=time.strftime("%Y-%m-%d"), device="cpu", model="SmolLM2-135M"
    )
    llm = LLM(max_model_len=2048, speculative_config=spec_cfg, print_memory_report=False)
    kinds = {}
    for kind, prompts in PROMPTS.items():
        start = len(log)
        outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], greedy, use_tqdm=False)
        steps = log[start:]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        accepted = [a for _, _, a in steps]
        # decode target steps: verify steps + plain steps (no draft found)
        plain_steps = tokens - len(outs) - sum(a + 1 for a in accepted)
        by_k = {}
        for k in range(1, ns.k + 1):
            cut = [min(a, k) for a in accepted]
            spec_tokens = sum(c + 1 for c in cut)
            by_k[k] = dict(
                mean_accepted_length_verify_steps=1 + statistics.mean(cut) if cut else None,
                # tokens per target decode step, counting steps without a draft as 1
                tokens_per_step=(spec_tokens + plain_steps) / (len(cut) + plain_steps),
            )
        kinds[kind] = dict(
            output_tokens=tokens,
            verify_steps=len(steps),
            steps_without_draft=plain_steps,
            by_k=by_k,
            texts=[o.outputs[0].text[:300] for o in outs],
        )
        print(kind, json.dumps(by_k[ns.k]), json.dumps(by_k[ns.timed_k]), flush=True)
    result["acceptance"] = kinds
    llm.shutdown()

    # End to end: plain vs n-gram at timed_k, alternating, same prompts, outputs compared.
    timed_cfg = dict(spec_cfg, num_speculative_tokens=ns.timed_k)
    engines = {
        "plain": LLM(max_model_len=2048, print_memory_report=False),
        "ngram": LLM(max_model_len=2048, speculative_config=timed_cfg, print_memory_report=False),
    }
    timing = {kind: {"plain": [], "ngram": []} for kind in PROMPTS}
    identical = True
    for _ in range(ns.rounds):
        for kind, prompts in PROMPTS.items():
            msgs = [[{"role": "user", "content": q}] for q in prompts]
            toks = {}
            for name, engine in engines.items():
                engine.llm_engine.core.kv_cache_manager.reset_prefix_cache()
                t = time.perf_counter()
                # one request at a time: batch-1 decode
                outs = [engine.chat([m], greedy, use_tqdm=False)[0] for m in msgs]
                timing[kind][name].append(time.perf_counter() - t)
                toks[name] = [o.outputs[0].token_ids for o in outs]
            identical &= toks["plain"] == toks["ngram"]
    result["end_to_end"] = {
        kind: dict(
            plain_s=statistics.median(t["plain"]),
            ngram_s=statistics.median(t["ngram"]),
            speedup=statistics.median(t["plain"]) / statistics.median(t["ngram"]),
        )
        for kind, t in timing.items()
    }
    result["end_to_end_k"] = ns.timed_k
    result["greedy_identical"] = identical
    print(json.dumps(result["end_to_end"]), "identical:", identical, flush=True)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

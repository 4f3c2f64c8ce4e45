"""Offline `LLM.generate` on exactly the prompts `pagoda bench serve` sends (same flags, same
seed): the same-session reference for the server's output tok/s.

    python benchmarks/serve/offline_same_prompts.py MODEL --token-prompts --num-prompts 512 \
        --input-len 512 --output-len 128 --out offline.json [engine options as JSON: --llm-kwargs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagoda.bench import serve as bench_serve


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--llm-kwargs", default="{}", help="JSON dict of LLM(...) options")
    bench_serve.add_arguments(p)
    ns = p.parse_args()
    from pagoda import LLM, SamplingParams

    prompts = bench_serve.make_prompts(ns)
    llm = LLM(ns.model, skip_tokenizer_init=ns.token_prompts, **json.loads(ns.llm_kwargs))
    sp = SamplingParams(
        temperature=ns.temperature, max_tokens=ns.output_len, ignore_eos=not ns.no_ignore_eos
    )
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "num_prompts": len(prompts),
        "elapsed_s": elapsed,
        "output_tok_s": n_out / elapsed,
        "req_s": len(prompts) / elapsed,
    }
    print(json.dumps(res))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

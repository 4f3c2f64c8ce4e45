"""Two engines one after the other in one process (issue 19, acceptance 2): Qwen2.5-7B bf16,
shut down, then Qwen2.5-7B W4A16; the W4A16 engine's KV cache is compared with what it gets
alone in a fresh process (must be within 5 %).

    python benchmarks/deploy/two_engines.py --out benchmarks/results/two_engines_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks/configs/qwen2.5-7b.json"


def engine(model: str, max_model_len: int) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    with LLM(model, skip_tokenizer_init=True, max_model_len=max_model_len) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)
        report = llm.memory_report()
        res = {
            "model": model,
            "kv_cache_gib": report.kv_cache_bytes / 2**30,
            "in_use_at_start_gib": report.in_use_at_start_bytes / 2**30,
            "tokens": out[0].outputs[0].token_ids,
        }
    res["allocated_after_shutdown_gib"] = torch.cuda.memory_allocated() / 2**30
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--alone", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.alone:
        print("@@" + json.dumps(engine(args.alone, args.max_model_len)))
        return 0
    first = engine(f"config:{CONFIG}", args.max_model_len)
    second = engine(f"config:{CONFIG}:w4a16", args.max_model_len)
    proc = subprocess.run(
        [sys.executable, __file__, "--out", args.out, "--alone", f"config:{CONFIG}:w4a16"],
        capture_output=True,
        text=True,
        check=True,
    )
    alone = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("@@"))[2:])
    ratio = second["kv_cache_gib"] / alone["kv_cache_gib"]
    result = {"first": first, "second": second, "alone": alone, "kv_ratio": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"bf16 KV {first['kv_cache_gib']:.2f} GiB; then W4A16 KV {second['kv_cache_gib']:.2f} GiB "
        f"vs alone {alone['kv_cache_gib']:.2f} GiB (ratio {ratio:.3f}); allocated after the "
        f"first shutdown {first['allocated_after_shutdown_gib']:.3f} GiB"
    )
    return 0 if abs(ratio - 1) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())

"""cpu_offload_gb on the GPU: Qwen2.5-7B bf16 under a 12 GiB per-process cap with
cpu_offload_gb=6, against the same model without offload and without the cap, each in its
own process. Greedy tokens must be equal; decode tok/s of both are reported side by side.

    python benchmarks/deploy/offload_7b.py --out benchmarks/results/offload_7b_h200.json

Dummy weights (`config:` shape) are drawn on the device in the same order in both engines;
`--model DIR` takes a real checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 785, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315]  # a short prompt


def worker(args: argparse.Namespace) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    util = args.gpu_memory_utilization
    if args.cap_gib:
        total = torch.cuda.mem_get_info()[1]
        fraction = args.cap_gib * 2**30 / total
        torch.cuda.set_per_process_memory_fraction(fraction)
        util *= fraction
    llm = LLM(
        args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=util,
        cpu_offload_gb=args.cpu_offload_gb,
        # the same small step in both engines: activations stay small under the cap
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        print_memory_report=False,
    )
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
    start = time.perf_counter()
    (out,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    m = out.metrics
    decode_s = m.last_token_time - m.first_token_time
    report = llm.memory_report()
    return {
        "cap_gib": args.cap_gib,
        "cpu_offload_gb": args.cpu_offload_gb,
        "tokens": out.outputs[0].token_ids,
        "decode_tok_s": (args.output_len - 1) / decode_s,
        "wall_s": time.perf_counter() - start,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "memory_report": report.to_dict(),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=f"config:{ROOT / 'benchmarks/configs/qwen2.5-7b.json'}")
    p.add_argument("--out", required=True)
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--cpu-offload-gb", type=float, default=6.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        print("@@" + json.dumps(worker(args)))
        return 0
    runs = {}
    for name, extra in (
        ("reference", ["--cap-gib", "0", "--cpu-offload-gb", "0"]),
        ("offload", ["--cap-gib", str(args.cap_gib), "--cpu-offload-gb", str(args.cpu_offload_gb)]),
    ):
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--out", args.out]
        cmd += ["--max-model-len", str(args.max_model_len), "--output-len", str(args.output_len)]
        proc = subprocess.run(cmd + extra, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        line = next(x for x in proc.stdout.splitlines() if x.startswith("@@"))
        runs[name] = json.loads(line[2:])
    same = runs["reference"]["tokens"] == runs["offload"]["tokens"]
    result = {"model": args.model, "greedy_equal": same, **runs}
    result["tok_s_ratio"] = runs["offload"]["decode_tok_s"] / runs["reference"]["decode_tok_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"greedy equal: {same}; decode tok/s reference {runs['reference']['decode_tok_s']:.1f}, "
        f"offload {runs['offload']['decode_tok_s']:.1f} (x{result['tok_s_ratio']:.3f}); "
        f"offloaded {runs['offload']['memory_report']['cpu_offload_bytes'] / 2**30:.2f} GiB, "
        f"peak {runs['offload']['peak_allocated_gib']:.2f} GiB"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

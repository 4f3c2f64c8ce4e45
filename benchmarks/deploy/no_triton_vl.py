"""Issue 19, acceptance 1 on the GPU: with Triton hidden from the process, the Qwen2.5-VL-3B
W4A16 shape answers a chat request carrying a 1280x720 data-URL image (torch paths, no CUDA
graphs). Speed is reported, not a target.

    python benchmarks/deploy/no_triton_vl.py --out benchmarks/results/no_triton_vl_h200.json
"""

from __future__ import annotations

import sys

sys.modules["triton"] = None  # before anything imports it: `import triton` fails, find_spec None

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--model", default=f"config:{ROOT / 'benchmarks/configs/qwen2.5-vl-3b.json'}:w4a16"
    )
    p.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/qwen2.5-tokenizer"))
    p.add_argument("--out", required=True)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()

    from pagoda import LLM, SamplingParams
    from pagoda.bench.edge import _chat
    from pagoda.platform import triton_available

    assert not triton_available()
    t0 = time.perf_counter()
    llm = LLM(
        args.model, tokenizer=args.tokenizer, max_model_len=8192, limit_mm_per_prompt={"image": 1}
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start = time.time()
    (out,) = llm.chat(_chat(1280, 720, 0), params, use_tqdm=False)
    m = out.metrics
    result = {
        "model": args.model,
        "triton_modules": sorted(
            k for k in sys.modules if k.split(".")[0] == "triton" and sys.modules[k]
        ),
        "startup_s": startup,
        "ttft_s": m.first_token_time - start,
        "decode_tok_s": (len(out.outputs[0].token_ids) - 1)
        / (m.last_token_time - m.first_token_time),
        "output_tokens": len(out.outputs[0].token_ids),
        "cuda_graphs": llm.memory_report().cuda_graph_sizes,
        "memory_report": llm.memory_report().to_dict(),
    }
    llm.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "memory_report"}))
    return 0 if result["output_tokens"] == args.output_len and not result["triton_modules"] else 1


if __name__ == "__main__":
    sys.exit(main())

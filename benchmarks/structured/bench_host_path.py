"""The host work of a grammar-constrained decode step, on this machine's CPU (no model).

A constrained step's mask can only be filled once the previous step's tokens are on the host,
so what the host does per step (accept, fill, detokenize) is on the critical path (BENCHMARKS.md,
"Structured outputs"). This measures two pieces of it with the Qwen2.5 tokenizer: the incremental
detokenizer per token (the Rust tokenizer's decode against transformers' wrapper, the same
text) and `StructuredOutputManager.bitmask()` for 32 rows of a JSON schema.

    python benchmarks/structured/bench_host_path.py [--tokenizer DIR] [--rows 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "qwen2.5-tokenizer"
TEXT = "The quick brown fox jumps over the lazy dog. 안녕하세요, 오늘 날씨가 좋네요! " * 30
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def detok_us_per_token(tok, ids: list[int], fast: bool) -> tuple[float, str]:
    from pagoda.engine.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, ids[:5])
    if not fast:
        d._fast = None  # the transformers wrapper, as for tokenizers that override _decode
    t0 = time.perf_counter()
    for i in ids:
        d.update([i])
    return (time.perf_counter() - t0) / len(ids) * 1e6, d.output_text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.rows < 1 or args.repeats < 1:
        raise SystemExit("--rows and --repeats must be at least 1")
    from transformers import AutoTokenizer

    from pagoda.sampling_params import StructuredOutputsParams
    from pagoda.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tok(TEXT)["input_ids"]
    for _ in range(args.repeats):
        slow, slow_text = detok_us_per_token(tok, ids, fast=False)
        fast, fast_text = detok_us_per_token(tok, ids, fast=True)
        print(
            f"detokenizer: wrapper {slow:.1f} us/token, Rust decode {fast:.1f} us/token, "
            f"same text: {slow_text == fast_text}"
        )
    mgr = StructuredOutputManager(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    rows = [mgr.new_request(StructuredOutputsParams(json=SCHEMA)) for _ in range(args.rows)]
    for r in rows:
        r.matcher  # noqa: B018 - wait for the compile, build the matcher
    for _ in range(args.repeats):
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            mgr.bitmask(rows)
            times.append(time.perf_counter() - t0)
        print(f"bitmask of {args.rows} rows: median {statistics.median(times) * 1e3:.3f} ms")
    mgr.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The `pagoda compare` command: registers the sub-command with the top-level CLI.

The work lives in `pagoda.bench.compare` (orchestration), `compare_worker` (one configuration
per process) and `compare_report` (table, JSON, plots); this module only wires the parser.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pagoda.bench import compare

    p = sub.add_parser(
        "compare",
        help="compare configurations: weights, KV cache, speed, perplexity (table + plots)",
        description="Run each model configuration in a fresh process and compare weights "
        "memory, KV cache size and capacity, load and CUDA-graph time, peak memory, TTFT, "
        "decode tok/s per batch size, throughput and perplexity, with ratios to the first.",
    )
    compare.add_arguments(p)
    p.set_defaults(func=compare.main)

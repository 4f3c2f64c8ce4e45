"""`pagoda bench {latency,throughput,serve}`: benchmark scripts behind one command.

Each benchmark lives in its own module exposing `add_arguments(parser)` and `main(ns) -> int`;
they are imported only when chosen, so the CLI starts fast and optional extras stay optional.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "latency": ("pagoda.bench.latency", "batch-1 TTFT, decode tok/s and memory-bandwidth use"),
    "throughput": ("pagoda.bench.throughput", "offline throughput on a random-length workload"),
    "serve": ("pagoda.bench.serve", "load a running OpenAI-compatible server"),
    "edge": ("pagoda.bench.edge", "small-GPU comparison under a per-process memory cap"),
}


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (latency, throughput, serve)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text)
        p.set_defaults(func=_runner(module), _bench_module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(func=_missing(name))
            continue
        mod.add_arguments(p)


def _runner(module: str):
    def run(ns: argparse.Namespace) -> int:
        return importlib.import_module(module).main(ns)

    return run


def _missing(name: str):
    def run(ns: argparse.Namespace) -> int:
        raise ValueError(f"the {name} benchmark is not available in this build")

    return run

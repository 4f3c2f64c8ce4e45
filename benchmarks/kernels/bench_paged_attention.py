"""Micro-benchmark of the Triton paged-attention and KV-cache-write kernels (CUDA only).

Decode batches (B x context) report KV-read bandwidth against a device-to-device copy measured
in the same run (CUDA-graph replays, as the runner runs decode); prefill and a mixed step report
TFLOP/s against torch SDPA on contiguous tensors (eager `do_bench`, L2 flushed per call).
`--sliding-window W` also times decode and prefill with the window (Mistral: 4096; blocks before
it are skipped), reported as `ms_window` and the speed-up over full attention in the same run.
Usage: PYTHONPATH=. python benchmarks/kernels/bench_paged_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
import triton
import triton.testing

from pagoda.kernels.attention.triton_kv_cache_write import write_kv_cache_triton
from pagoda.kernels.attention.triton_paged_attention import (
    choose_num_splits,
    paged_attention_triton,
)


def bench_ms(fn) -> float:
    """Eager median time (includes the Python launch cost; right for ms-scale kernels)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph_ms(fns: list) -> float:
    """Median time per call of `fns`, replayed as one CUDA graph (as the runner does decode).

    The calls read different blocks of a large cache one after another, so consecutive calls
    do not hit each other's keys in L2.
    """
    for fn in fns:
        fn()  # compile outside the capture
    # do_bench_cudagraph runs on a stream of its own, which does not wait for the default
    # stream: without this, its first calls could read inputs still being written (the
    # random caches and block tables the callers just made), and from garbage block ids fault
    torch.cuda.synchronize()

    def run_all() -> None:
        for fn in fns:
            fn()

    return triton.testing.do_bench_cudagraph(run_all, rep=100, return_mode="median") / len(fns)


def distinct_calls(kv_bytes: int, min_bytes: int = 512 << 20, max_calls: int = 32) -> int:
    """How many independent batches to chain so that one pass reads well past the 60 MB L2."""
    return max(1, min(max_calls, math.ceil(min_bytes / kv_bytes)))


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


class PagedCache:
    """One big random cache; each batch gets random (non-contiguous) blocks of it."""

    def __init__(self, max_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype):
        self.block_size = block_size
        self.num_blocks = math.ceil(max_tokens / block_size) + 1
        shape = (2, self.num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.randn(shape, dtype=dtype, device="cuda")

    def tables(self, seq_lens: list[int]) -> torch.Tensor:
        per_seq = [math.ceil(s / self.block_size) for s in seq_lens]
        assert sum(per_seq) < self.num_blocks, "cache too small for this batch"
        perm = torch.randperm(self.num_blocks - 1, device="cuda") + 1
        tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device="cuda")
        first = 0
        for b, n in enumerate(per_seq):
            tables[b, :n] = perm[first : first + n]
            first += n
        return tables


def run_attention(cache: PagedCache, specs: list[tuple[int, int]], num_heads: int, **kw):
    """Returns a closure that runs one attention call for (q_len, seq_len) specs."""
    head_dim = cache.kv.shape[4]
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=cache.kv.dtype, device="cuda")
    out = torch.empty_like(q)
    args = (
        q,
        cache.kv,
        qsl.cuda(),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        cache.tables(seq_lens),
        head_dim**-0.5,
        max(q_lens),
        max(seq_lens),
    )
    return lambda: paged_attention_triton(*args, out=out, **kw)


def attention_flops(specs: list[tuple[int, int]], num_heads: int, head_dim: int) -> float:
    """QK^T and PV over the causally visible keys: 4 * H * D per (query, visible key)."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in specs)
    return 4.0 * num_heads * head_dim * pairs


def bench_decode(args, cache: PagedCache, copy_gbps: float) -> list[dict]:
    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes_per_token = 2 * args.kv_heads * args.head_dim * cache.kv.element_size()
    for batch in args.batch_sizes:
        for ctx in args.contexts:
            if batch * ctx > args.max_kv_tokens:
                continue
            specs = [(1, ctx)] * batch
            splits = choose_num_splits(batch, args.kv_heads, 1, ctx, num_sms)
            kv_bytes = batch * ctx * kv_bytes_per_token
            calls = distinct_calls(kv_bytes)
            ms_auto = bench_graph_ms(
                [run_attention(cache, specs, args.heads) for _ in range(calls)]
            )
            ms_single = ms_auto
            if splits > 1:
                ms_single = bench_graph_ms(
                    [run_attention(cache, specs, args.heads, num_splits=1) for _ in range(calls)]
                )
            gbps = kv_bytes / (ms_auto * 1e-3) / 1e9
            row = {
                "batch": batch,
                "context": ctx,
                "num_splits": splits,
                "ms": ms_auto,
                "ms_no_split": ms_single,
                "kv_read_GBps": gbps,
                "fraction_of_copy_bw": gbps / copy_gbps,
            }
            line = (
                f"decode B={batch:4d} ctx={ctx:6d} splits={splits:2d} {ms_auto * 1e3:9.1f} us "
                f"(no split {ms_single * 1e3:9.1f} us)  KV {gbps:7.0f} GB/s = "
                f"{gbps / copy_gbps:5.1%} of copy"
            )
            if args.sliding_window:
                window = args.sliding_window
                row["ms_window"] = bench_graph_ms(
                    [
                        run_attention(cache, specs, args.heads, sliding_window=window)
                        for _ in range(calls)
                    ]
                )
                row["window_speedup"] = ms_auto / row["ms_window"]
                line += f" | W={window}: {row['ms_window'] * 1e3:9.1f} us"
            rows.append(row)
            print(line)
    return rows


def bench_prefill(args, cache: PagedCache) -> dict:
    """One fresh causal prompt of T tokens: paged kernel vs SDPA on contiguous expanded K/V."""
    tokens, heads, kv_heads, dim = args.prefill_tokens, args.heads, args.kv_heads, args.head_dim
    ms = bench_ms(run_attention(cache, [(tokens, tokens)], heads))
    flops = attention_flops([(tokens, tokens)], heads, dim)
    q = torch.randn(1, heads, tokens, dim, dtype=cache.kv.dtype, device="cuda")
    k = torch.randn(1, kv_heads, tokens, dim, dtype=cache.kv.dtype, device="cuda")
    v = torch.randn_like(k)
    # Expanded K/V so SDPA takes its fastest (flash / cuDNN) backend; expansion is not timed.
    k_full = k.repeat_interleave(heads // kv_heads, dim=1)
    v_full = v.repeat_interleave(heads // kv_heads, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms_sdpa = bench_ms(lambda: sdpa(q, k_full, v_full, is_causal=True))
    result = {
        "tokens": tokens,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "sdpa_ms": ms_sdpa,
        "sdpa_tflops": flops / (ms_sdpa * 1e-3) / 1e12,
        "speed_vs_sdpa": ms_sdpa / ms,
    }
    if args.sliding_window:
        w = args.sliding_window
        result["ms_window"] = bench_ms(
            run_attention(cache, [(tokens, tokens)], heads, sliding_window=w)
        )
        result["window_speedup"] = ms / result["ms_window"]
        print(f"prefill T={tokens} window {w}: {result['ms_window']:.3f} ms")
    print(
        f"prefill T={tokens}: {ms:.3f} ms {result['tflops']:.0f} TFLOP/s | SDPA {ms_sdpa:.3f} ms "
        f"{result['sdpa_tflops']:.0f} TFLOP/s | ratio {result['speed_vs_sdpa']:.2f}"
    )
    return result


def bench_mixed(args, cache: PagedCache, copy_gbps: float) -> dict:
    """A chunked-prefill step: a 2048-token chunk over a 2048 prefix plus 128 decodes at 4k."""
    specs = [(2048, 4096)] + [(1, 4096)] * 128
    ms = bench_ms(run_attention(cache, specs, args.heads))
    flops = attention_flops(specs, args.heads, args.head_dim)
    kv_bytes = sum(s for _, s in specs) * 2 * args.kv_heads * args.head_dim * 2
    result = {
        "specs": "1 x (2048 over 2048 prefix) + 128 x decode@4096",
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "kv_read_GBps": kv_bytes / (ms * 1e-3) / 1e9,
    }
    result["fraction_of_copy_bw"] = result["kv_read_GBps"] / copy_gbps
    print(
        f"mixed step: {ms:.3f} ms  {result['tflops']:.0f} TFLOP/s  "
        f"KV {result['kv_read_GBps']:.0f} GB/s"
    )
    return result


def bench_kv_write(args, cache: PagedCache, copy_gbps: float) -> dict:
    tokens = args.prefill_tokens
    key = torch.randn(tokens, args.kv_heads, args.head_dim, dtype=cache.kv.dtype, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(cache.num_blocks * cache.block_size, device="cuda")[:tokens]
    ms = bench_graph_ms([lambda: write_kv_cache_triton(key, value, cache.kv, slots)])
    moved = 2 * 2 * key.numel() * key.element_size()  # read K, V + write K, V
    gbps = moved / (ms * 1e-3) / 1e9
    print(f"kv write T={tokens}: {ms * 1e3:.1f} us  {gbps:.0f} GB/s = {gbps / copy_gbps:.1%}")
    return {"tokens": tokens, "ms": ms, "GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--heads", type=int, default=28, help="query heads (Qwen2.5-7B: 28)")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="also time with this window (Mistral)"
    )
    parser.add_argument(
        "--max-kv-tokens", type=int, default=256 * 32768, help="skip decode batches above this"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")

    copy_gbps = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    cache = PagedCache(
        max(args.max_kv_tokens, 2 * args.prefill_tokens, 4096 * 130),
        args.kv_heads,
        args.head_dim,
        args.block_size,
        torch.bfloat16,
    )
    results = {
        "device": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": {
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": "bfloat16",
            "sliding_window": args.sliding_window,
        },
        "copy_bandwidth_GBps": copy_gbps,
        "decode": bench_decode(args, cache, copy_gbps),
        "prefill": bench_prefill(args, cache),
        "mixed": bench_mixed(args, cache, copy_gbps),
        "kv_write": bench_kv_write(args, cache, copy_gbps),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

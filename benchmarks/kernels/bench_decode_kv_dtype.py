"""The fused decode attention kernel by KV-cache dtype (CUDA only): bf16, e4m3 (Triton's own
conversion, sm_89+) and e4m3 read as uint8 codes (the integer decode of sm_80 / 87, forced here
with `soft_e4m3=True` so a Hopper times what an Orin runs), one decode step of B sequences of
context C, replayed as a CUDA graph over distinct blocks of a large cache (no L2 reuse).

Reports microseconds per call and the ratio to the bf16 cache in the same run; `--tiles` also
times each (BLOCK_N, num_warps, num_stages) for the uint8 cache (the launcher's choice is
`_launch_config`; the sweep replaces it for that run only).

    PYTHONPATH=. python benchmarks/kernels/bench_decode_kv_dtype.py --model 7b --out R.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
from bench_paged_attention import bench_graph_ms, distinct_calls

from pagoda.kernels.attention import triton_decode_attention as tda
from pagoda.layers.rotary import RotaryEmbedding

SHAPES = {"7b": (28, 4, 128), "3b": (16, 2, 128), "0.5b": (14, 2, 64)}  # (heads, kv heads, D)
BLOCK = 16


def make_call(b: int, ctx: int, heads: int, kv_heads: int, d: int, kv_dtype, soft: bool, rope):
    """One decode step: B tokens at position ctx - 1 over a random paged cache of ctx tokens."""
    n_blocks = b * math.ceil(ctx / BLOCK) + 1
    kv = torch.randn(2, n_blocks, BLOCK, kv_heads, d, device="cuda").clamp(-8, 8).to(kv_dtype)
    perm = (torch.randperm(n_blocks - 1, device="cuda") + 1).int()
    per = math.ceil(ctx / BLOCK)
    tables = perm[: b * per].view(b, per).contiguous()
    q = torch.randn(b, heads * d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kv_heads * d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.full((b,), ctx - 1, device="cuda", dtype=torch.int64)
    seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    slots = (tables[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK).contiguous()
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    fp8 = kv_dtype != torch.bfloat16

    def call() -> None:
        tda.fused_decode_attention_triton(
            pos, q, k, v, rope.cos_cache, rope.sin_cache, kv, slots, qsl, seq_lens, tables,
            d**-0.5, ctx, out=out, k_scale=0.05 if fp8 else 1.0, v_scale=0.05 if fp8 else 1.0,
            soft_e4m3=soft if fp8 else None,
        )  # fmt: skip

    return call


def kv_bytes(b: int, ctx: int, kv_heads: int, d: int, kv_dtype) -> int:
    """Bytes of K and V one decode step reads (whole blocks)."""
    per = math.ceil(ctx / BLOCK)
    return 2 * b * per * BLOCK * kv_heads * d * torch.empty(0, dtype=kv_dtype).element_size()


def time_us(make, nbytes: int) -> float:
    """Per call, replayed as one CUDA graph over distinct caches (no L2 reuse between calls)."""
    return bench_graph_ms([make() for _ in range(distinct_calls(nbytes))]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(SHAPES), default="7b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--tiles", action="store_true", help="sweep the uint8 path's tile choice")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    if min(ns.batch_sizes) < 1 or min(ns.contexts) < 2:
        p.error("--batch-sizes must be >= 1 and --contexts >= 2 (a cached key and the new one)")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    heads, kv_heads, d = SHAPES[ns.model]
    rope = RotaryEmbedding(d, max(ns.contexts) + 1, 1_000_000.0).cuda()
    native = torch.cuda.get_device_capability() >= (8, 9)
    kinds = [("bf16", torch.bfloat16, False), ("e4m3 uint8", torch.float8_e4m3fn, True)]
    if native:
        kinds.insert(1, ("e4m3", torch.float8_e4m3fn, False))
    rows = []
    default_cfg = tda._launch_config
    for b in ns.batch_sizes:
        for ctx in ns.contexts:
            row = {"batch": b, "context": ctx}
            for name, dt, soft in kinds:

                def make(dt=dt, soft=soft, b=b, ctx=ctx):
                    return make_call(b, ctx, heads, kv_heads, d, dt, soft, rope)

                nbytes = kv_bytes(b, ctx, kv_heads, d, dt)
                row[name] = time_us(make, nbytes)
                row[f"{name} GB/s"] = nbytes / row[name] / 1e3
            if ns.tiles:
                for bn in (16, 32, 64, 128):
                    for warps, stages in ((2, 2), (4, 2), (4, 3)):

                        def cfg(*a, bn=bn, warps=warps, stages=stages):
                            return default_cfg(*a)[0], bn, warps, stages

                        tda._launch_config = cfg
                        try:
                            row[f"uint8 n{bn} w{warps} s{stages}"] = time_us(
                                lambda b=b, ctx=ctx: make_call(
                                    b, ctx, heads, kv_heads, d, torch.float8_e4m3fn, True, rope
                                ),
                                kv_bytes(b, ctx, kv_heads, d, torch.float8_e4m3fn),
                            )
                        finally:
                            tda._launch_config = default_cfg
            base = row["bf16"]
            print(
                f"B={b:3d} ctx={ctx:6d}  "
                + "  ".join(f"{n} {row[n]:.1f} us ({base / row[n]:.2f}x)" for n, _, _ in kinds),
                flush=True,
            )
            rows.append(row)
    result = {
        "benchmark": "fused decode attention by KV-cache dtype",
        "model_shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": d},
        "gpu": torch.cuda.get_device_name(),
        "commit": ns.commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

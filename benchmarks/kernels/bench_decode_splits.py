"""The batch-1 fused decode attention (RoPE + cache write + attention + split-KV reduce) against
its split-KV factor, Qwen2.5-3B / 7B heads, at the contexts of the decode benchmarks (CUDA only).

Why: at batch 1 the decode graph is captured with the split that `choose_num_splits` gives for
`max_model_len` (32 for 4,096 tokens on 2 KV heads), and every shorter context is cut into that
many chunks (a 640-token context: 32 chunks of 20 keys) whose partials the reduce kernel then
merges. Session 11's profile put attention at 8.2 µs per 3B layer for ~0.7 MB of KV: the
largest per-layer cost after the GEMVs. This times each split at each context, one layer's
call per decoder layer chained in one CUDA graph (distinct caches, as a decode step reads).

    python benchmarks/kernels/bench_decode_splits.py --out benchmarks/results/decode_splits.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.bench.common import cuda_device, environment, write_result  # noqa: E402
from pagoda.bench.common import graph_time_per_call as time_graph  # noqa: E402
from pagoda.kernels.attention.triton_decode_attention import fused_decode_attention_triton  # noqa: E402
from pagoda.kernels.attention.triton_paged_attention import choose_num_splits  # noqa: E402

MODELS = {"3b": (16, 2, 36), "7b": (28, 4, 28)}  # query heads, KV heads, layers (head size 128)
HEAD_DIM = 128
BLOCK = 16


class Layer:
    """One decoder layer's paged cache holding a context of `ctx` tokens, and a decode token."""

    def __init__(self, heads: int, kv_heads: int, ctx: int, dev, g) -> None:
        blocks = math.ceil((ctx + 1) / BLOCK) + 1
        self.kv = torch.randn(2, blocks, BLOCK, kv_heads, HEAD_DIM, device=dev, generator=g)
        self.kv = self.kv.bfloat16()
        qkv = torch.randn(1, (heads + 2 * kv_heads) * HEAD_DIM, device=dev, generator=g)
        qkv = qkv.bfloat16()
        self.q = qkv[:, : heads * HEAD_DIM]
        self.k = qkv[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM]
        self.v = qkv[:, (heads + kv_heads) * HEAD_DIM :]
        self.table = torch.randperm(blocks - 1, device=dev, generator=g)[None].int() + 1
        self.slot = torch.tensor([int(self.table[0, ctx // BLOCK]) * BLOCK + ctx % BLOCK],
                                 device=dev)  # fmt: skip
        self.out = torch.empty(1, heads * HEAD_DIM, device=dev, dtype=torch.bfloat16)


def _calls(stack: list[Layer], pos, seq, cos, sin, qsl, split: int, max_len: int):
    """`call(i)`: layer i's fused decode attention with `split` KV splits."""

    def call(i: int) -> torch.Tensor:
        ly = stack[i]
        return fused_decode_attention_triton(
            pos, ly.q, ly.k, ly.v, cos, sin, ly.kv, ly.slot, qsl, seq, ly.table,
            HEAD_DIM**-0.5, max_len, num_splits=split, out=ly.out,
        )  # fmt: skip

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="3b,7b")
    ap.add_argument("--contexts", default="128,640,2048,8192")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-model-len", type=int, default=4096, help="for the graph's own pick")
    ns = ap.parse_args()
    unknown = sorted(set(ns.models.split(",")) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    for name in ("contexts", "splits"):
        values = getattr(ns, name).split(",")
        if not all(v.strip().isdigit() and int(v) > 0 for v in values):
            ap.error(
                f"--{name} takes positive integers separated by commas, got {getattr(ns, name)!r}"
            )
    dev = cuda_device("bench_decode_splits.py")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for model in ns.models.split(","):
        heads, kv_heads, layers = MODELS[model]
        picked = choose_num_splits(1, kv_heads, 1, ns.max_model_len, sms)
        half = HEAD_DIM // 2
        cos = torch.rand(65536, half, device=dev, generator=g)
        sin = torch.rand(65536, half, device=dev, generator=g)
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        for ctx in map(int, ns.contexts.split(",")):
            stack = [Layer(heads, kv_heads, ctx, dev, g) for _ in range(layers)]
            pos = torch.tensor([ctx], device=dev)
            seq = torch.tensor([ctx + 1], dtype=torch.int32, device=dev)
            row = {"model": model, "context": ctx, "graph_split": picked, "us": {}}
            for split in map(int, ns.splits.split(",")):
                call = _calls(stack, pos, seq, cos, sin, qsl, split, ns.max_model_len)
                row["us"][split] = time_graph(call, layers) * 1e6
            best = min(row["us"], key=row["us"].get)
            row["best_split"] = best
            rows.append(row)
            cells = "  ".join(f"{s}: {t:5.1f}" for s, t in row["us"].items())
            print(
                f"{model} ctx {ctx:5d}  µs per layer by split  {cells}  (graph's pick {picked}, "
                f"best {best})",
                flush=True,
            )
    write_result(ns.out, {"env": environment(dev), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

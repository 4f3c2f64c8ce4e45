"""What does each kind of small kernel cost inside the batch-1 decode graph? (issue 4)

Loads the model once, runs one greedy request (so the graph's static inputs hold a real
sequence: prompt + output tokens of KV), then re-captures the batch-1 decode graph with parts of
the decoder layer removed and times each graph replayed back to back (no host work). The
outputs of an ablated graph are garbage; only the time is read. The differences are what those
kernels cost in the PDL-chained graph, where a kernel's profiler duration overlaps its
neighbours and says little.

    python benchmarks/ablate_decode.py config:benchmarks/configs/qwen2.5-7b.json:w4a16 --out F

`--batch B` times the decode graph of B sequences instead (B prompts, the engine's
`max_num_seqs` = B).

Ablations (cumulative names are joined with '+'):
    norm     RMSNorm returns its input (and the residual unchanged): no norm kernels
    silu     SiluAndMul returns the gate half as a strided view: no activation kernel
    attn     attention returns q: no RoPE / cache write / attention / split-KV reduce kernels
    nokv     the decode attention does not prefetch its first cache blocks before its wait
             (`PAGODA_DISABLED_KERNELS=kv_prefetch`)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.common import wall_time_per_call as timed


@contextlib.contextmanager
def ablated(parts: set[str]) -> Iterator[None]:
    from pagoda.layers import attention
    from pagoda.layers.activation import SiluAndMul
    from pagoda.layers.norm import RMSNorm
    from pagoda.models.llama import DecoderAttention

    saved = (RMSNorm.forward, SiluAndMul.forward, DecoderAttention.forward)
    kv_prefetch = attention._kv_prefetch
    if "nokv" in parts:
        attention._kv_prefetch = lambda: False
    if "norm" in parts:

        def norm_forward(self, x, residual=None):
            return x if residual is None else (x, residual)

        RMSNorm.forward = norm_forward
    if "silu" in parts:
        SiluAndMul.forward = lambda self, x: x[:, : x.shape[1] // 2]
    if "attn" in parts:

        def attn_forward(self, positions, hidden, attn_metadata):
            return self.o_proj(self.qkv_proj(hidden)[:, : self.q_size])

        DecoderAttention.forward = attn_forward
    try:
        yield
    finally:
        RMSNorm.forward, SiluAndMul.forward, DecoderAttention.forward = saved
        attention._kv_prefetch = kv_prefetch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--batch", type=int, default=1, help="the decode graph of this many sequences")
    p.add_argument(
        "--ablations", default="none,norm,silu,attn,norm+silu,norm+silu+attn",
        help="comma-separated; 'none' is the real graph",
    )  # fmt: skip
    ns = p.parse_args()
    names = ns.ablations.split(",")
    for name in names:
        for part in [] if name == "none" else name.split("+"):
            if part not in ("norm", "silu", "attn", "nokv"):
                p.error(f"--ablations: unknown part {part!r} in {name!r}")
    llm = LLM(
        ns.model,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        max_num_seqs=ns.batch,
        skip_tokenizer_init=True,
    )
    runner = llm.llm_engine.core.runner
    model = runner.model
    gr = runner.graph_runner
    if ns.batch < 1:
        p.error("--batch: at least 1")
    prompt = [[(7 * i + b) % 10000 for i in range(ns.prompt_len)] for b in range(ns.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)
    res: dict = {
        "model": ns.model,
        "gpu": torch.cuda.get_device_name(),
        "batch": ns.batch,
        "seq_len": int(gr.seq_lens[0]),
        "graph_s": {},  # per ablation: the median over its captures
        "graph_runs": [],  # [name, seconds] per capture, in order (spread between captures)
    }
    hid = gr.outputs[ns.batch]
    res["logits_argmax_s"] = timed(lambda: model.compute_logits(hid).argmax(-1), ns.iters)
    for name in names:
        parts = set() if name == "none" else set(name.split("+"))
        with ablated(parts):
            gr.graphs.clear()
            gr.capture()
        t = timed(gr.graphs[ns.batch].replay, ns.iters)
        res["graph_runs"].append([name, t])
        print(f"{name:20s} {t * 1e6:8.1f} us", flush=True)
    for name in dict.fromkeys(n for n, _ in res["graph_runs"]):
        res["graph_s"][name] = statistics.median(t for n, t in res["graph_runs"] if n == name)
    base = res["graph_s"].get("none")
    if base:
        res["saved_per_layer_us"] = {
            k: (base - v) * 1e6 / len(model.model.layers) for k, v in res["graph_s"].items()
        }
    Path(ns.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

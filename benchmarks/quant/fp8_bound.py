"""The ceiling on FP8 W8A8's decode speed-up over bf16, measured (CUDA only; issue 43).

FP8 weights halve the bytes each linear layer reads, and nothing else in a decode step: attention,
norms, rotary, the bf16 lm_head (FP8_DYNAMIC leaves it dense) and sampling stay as they are. So
one process per format measures, at each batch size B:

- `step_s`: one decode step of B sequences with no host work (the engine's CUDA graph of the
  decoder replayed, then lm_head + argmax), at the context the last step of a short generation had;
- `linear_s`: every linear layer of the decoder at B rows, each module timed as a CUDA graph of 20
  calls (its own input quantization launch included for FP8), summed with its multiplicity;
- `other_s = step_s - linear_s`: the part FP8 weights do not touch;
- `fp8_linear_floor_s`: the FP8 weight bytes (codes + per-channel scales) over the copy bandwidth,
  the least time any kernel can read them in.

The bf16 run's `fp8_ceiling = step_s / (other_s + fp8_linear_floor_s)` is the largest FP8 / bf16
ratio possible at that batch; the FP8 run's `linear_floor_fraction` says how near its kernels come.

    M=config:benchmarks/configs/qwen2.5-3b.json
    PYTHONPATH=. python benchmarks/quant/fp8_bound.py $M --batch-sizes 1 64 128 --out bf16.json
    PYTHONPATH=. python benchmarks/quant/fp8_bound.py $M:fp8 --batch-sizes 1 64 128 --out fp8.json
    python benchmarks/quant/fp8_bound.py --report bf16.json fp8.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch


def graph_time(fn, calls: int = 20, iters: int = 20) -> float:
    """Seconds per call of `fn`, captured `calls` times in one CUDA graph (no launch overhead)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * calls)


def timed(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def measure(ns: argparse.Namespace) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.bench.common import copy_bandwidth
    from pagoda.layers.linear import LinearBase

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    llm = LLM(
        ns.model,
        dtype="bfloat16",
        max_model_len=ns.prompt_len + ns.output_len + 64,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_num_seqs=max(8, *ns.batch_sizes),
        skip_tokenizer_init=True,
    )
    runner = llm.llm_engine.core.runner
    model = runner.model
    gr = runner.graph_runner

    # the decoder's linear layers, grouped by (method, shape): one timing per group
    groups: dict[tuple, list] = {}
    for mod in model.modules():
        if isinstance(mod, LinearBase) and "lm_head" not in mod.prefix:
            key = (type(mod.linear_method).__name__, mod.in_features, mod.out_features)
            groups.setdefault(key, []).append(mod)
    res: dict = {
        "model": ns.model,
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "commit": ns.commit,
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_bytes_per_s": bw,
        "prompt_len": ns.prompt_len,
        "rows": [],
    }
    for b in ns.batch_sizes:
        prompts = [[(7 * i + 13 * j + b) % 10000 for i in range(ns.prompt_len)] for j in range(b)]
        sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
        key = min((s, -w) for s, w in gr.graphs if s >= b)
        key = (key[0], -key[1])
        g, hid = gr.graphs[key], gr.outputs[key]

        def step(g=g, hid=hid) -> None:
            g.replay()
            model.compute_logits(hid).argmax(-1)

        step_s = timed(step, 100)
        linear_s = 0.0
        fp8_bytes = 0
        shapes = []
        for (method, k, n), mods in groups.items():
            mod = mods[0]
            x = torch.randn(key[0], k, device=dev, dtype=torch.bfloat16)
            with torch.inference_mode():
                t = graph_time(lambda mod=mod, x=x: mod(x))
            linear_s += t * len(mods)
            fp8_bytes += len(mods) * (n * k + 4 * n)  # e4m3 codes + a float32 scale a channel
            shapes.append({"method": method, "in": k, "out": n, "count": len(mods), "us": t * 1e6})
        floor = fp8_bytes / bw
        other = step_s - linear_s
        row = {
            "batch": b,
            "graph_size": key[0],
            "step_s": step_s,
            "linear_s": linear_s,
            "other_s": other,
            "fp8_linear_floor_s": floor,
            "fp8_ceiling": step_s / (other + floor),
            "linear_floor_fraction": floor / linear_s,
            "linears": shapes,
        }
        res["rows"].append(row)
        print(
            f"batch {b:4d}: step {step_s * 1e3:.3f} ms, linears {linear_s * 1e3:.3f} ms, other "
            f"{other * 1e3:.3f} ms, FP8 linear floor {floor * 1e3:.3f} ms -> ceiling "
            f"{row['fp8_ceiling']:.2f}x",
            flush=True,
        )
    return res


def report(bf16_path: str, fp8_path: str) -> str:
    a = json.loads(Path(bf16_path).read_text())
    f = json.loads(Path(fp8_path).read_text())
    if a["device"] != f["device"]:
        raise SystemExit(f"different devices: {a['device']} vs {f['device']}")
    lines = [
        f"{a['model']} vs {f['model']} ({a['device']}, {a['date']}, {a['commit']})",
        "| batch | bf16 step ms | FP8 step ms | FP8 / bf16 | ceiling | bf16 linears ms | "
        "FP8 linears ms | FP8 floor ms | other ms bf16 / FP8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fr = {r["batch"]: r for r in f["rows"]}
    for r in a["rows"]:
        q = fr.get(r["batch"])
        if q is None:
            continue
        lines.append(
            f"| {r['batch']} | {r['step_s'] * 1e3:.3f} | {q['step_s'] * 1e3:.3f} | "
            f"{r['step_s'] / q['step_s']:.2f}x | {r['fp8_ceiling']:.2f}x | "
            f"{r['linear_s'] * 1e3:.3f} | {q['linear_s'] * 1e3:.3f} | "
            f"{r['fp8_linear_floor_s'] * 1e3:.3f} | {r['other_s'] * 1e3:.3f} / "
            f"{q['other_s'] * 1e3:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 128])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--commit", default="unknown", help="typed into the result (the device's .git)")
    p.add_argument("--out")
    p.add_argument("--report", nargs=2, metavar=("BF16_JSON", "FP8_JSON"))
    ns = p.parse_args()
    if ns.report:
        print(report(*ns.report))
        return 0
    if not ns.model or not ns.out:
        p.error("MODEL and --out are required (or --report BF16_JSON FP8_JSON)")
    if any(not 1 <= b <= 512 for b in ns.batch_sizes):
        p.error(f"--batch-sizes must be in 1..512, got {ns.batch_sizes}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    res = measure(ns)
    Path(ns.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

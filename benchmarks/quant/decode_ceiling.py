"""The ceiling on a weight format's decode speed-up over bf16, measured (CUDA only; issue 43).

Smaller weights shorten only the linear layers of a decode step: attention, norms, rotary, the
bf16 lm_head (FP8_DYNAMIC and W4A16 leave it dense) and sampling stay as they are. One process per
format measures, at each batch size B:

- `step_s`: one decode step of B sequences with no host work (the engine's CUDA graph of the
  decoder replayed, then lm_head + argmax), at the context the last step of a short generation had;
- `linear_s`: every linear layer of the decoder at B rows (the graph's row count), each module
  timed in a CUDA graph over copies of it that stream > 4x the L2 from HBM, as a decode step
  does (FP8's input quantization launch included), summed with its multiplicity;
- `other_s = step_s - linear_s`: the part the weight format does not touch;
- per format, each linear's floor: the larger of its weight bytes over the copy bandwidth (FP8:
  e4m3 codes + a float32 scale a channel; W4A16: 4-bit codes + a bf16 scale a group of 128) and its
  2·B·K·N products over the measured dense peak (bf16 cuBLAS on 8192³; FP8's tensor cores at 2×).

The bf16 run's `ceiling[fmt] = step_s / (other_s + floor[fmt])` is the largest ratio that format
can reach over bf16 at that batch; a quantized run's `linear_floor_fraction` says how near its
kernels come to their floor.

    M=config:benchmarks/configs/qwen2.5-3b.json
    PYTHONPATH=. python benchmarks/quant/decode_ceiling.py $M --out bf16.json
    PYTHONPATH=. python benchmarks/quant/decode_ceiling.py $M:fp8 --out fp8.json
    PYTHONPATH=. python benchmarks/quant/decode_ceiling.py $M:w4a16 --out w4a16.json
    python benchmarks/quant/decode_ceiling.py --report bf16.json fp8.json w4a16.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import sys
from pathlib import Path

import torch

from pagoda.bench.common import graph_time_per_call
from pagoda.bench.common import wall_time_per_call as timed

FORMATS = ("fp8", "w4a16")


def weight_bytes(fmt: str, k: int, n: int) -> int:
    """Bytes a [n, k] linear's weight takes in `fmt` (what its kernel must read)."""
    if fmt == "fp8":
        return n * k + 4 * n  # e4m3 codes + a float32 scale a channel
    if fmt == "w4a16":
        return n * k // 2 + 2 * n * ((k + 127) // 128)  # 4-bit codes + a bf16 scale a group
    return 2 * n * k


def dense_peak_flops(dev: torch.device) -> float:
    """bf16 cuBLAS FLOP/s on an 8192^3 matmul: the practical dense peak."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = graph_time_per_call(lambda i: a @ b, copies=5, replays=10, reps=3)
    return 2 * 8192**3 / t


def measure(ns: argparse.Namespace) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.bench.common import copy_bandwidth
    from pagoda.layers.linear import LinearBase

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    peak = dense_peak_flops(dev)
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
        "dense_bf16_flops_per_s": peak,
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
        m = key[0]
        linear_s = 0.0
        floors = dict.fromkeys(("bf16", *FORMATS), 0.0)
        shapes = []
        for (method, k, n), mods in groups.items():
            # copies of the module so a replay streams > 4x the L2 from HBM, as a decode step does
            nbytes = sum(t.numel() * t.element_size() for t in mods[0].state_dict().values())
            n_copies = max(1, min(64, math.ceil(4 * l2 / max(nbytes, 1))))
            copies = [mods[0]] + [copy.deepcopy(mods[0]) for _ in range(n_copies - 1)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            with torch.inference_mode():
                t = graph_time_per_call(lambda i, c=copies, x=x: c[i](x), n_copies, reps=3)
            del copies
            linear_s += t * len(mods)
            flops = 2 * m * k * n
            for fmt in floors:
                rate = 2 * peak if fmt == "fp8" else peak
                floors[fmt] += len(mods) * max(weight_bytes(fmt, k, n) / bw, flops / rate)
            shapes.append({"method": method, "in": k, "out": n, "count": len(mods), "us": t * 1e6})
        other = step_s - linear_s
        row = {
            "batch": b,
            "graph_size": m,
            "step_s": step_s,
            "linear_s": linear_s,
            "other_s": other,
            "linear_floor_s": floors,
            "ceiling": {f: step_s / (other + floors[f]) for f in FORMATS},
            "linears": shapes,
        }
        res["rows"].append(row)
        print(
            f"batch {b:4d}: step {step_s * 1e3:.3f} ms, linears {linear_s * 1e3:.3f} ms "
            f"(bf16 floor {floors['bf16'] * 1e3:.3f}), other {other * 1e3:.3f} ms; ceilings "
            + ", ".join(f"{f} {c:.2f}x" for f, c in row["ceiling"].items()),
            flush=True,
        )
    return res


def report(bf16_path: str, *paths: str) -> str:
    """One table per quantized run: measured ratio, the ceiling, and where the time goes."""
    a = json.loads(Path(bf16_path).read_text())
    lines = [f"{a['model']} ({a['device']}, {a['date']}, {a['commit']})"]
    for path in paths:
        f = json.loads(Path(path).read_text())
        if a["device"] != f["device"]:
            raise SystemExit(f"different devices: {a['device']} vs {f['device']}")
        fmt = next((x for x in FORMATS if f["model"].lower().endswith(":" + x)), None)
        if fmt is None:
            raise SystemExit(f"{path}: model {f['model']!r} names none of {', '.join(FORMATS)}")
        lines += [
            "",
            f"{fmt} ({f['model']}):",
            f"| batch | bf16 step ms | {fmt} step ms | {fmt} / bf16 | ceiling | bf16 linears ms"
            f" (floor) | {fmt} linears ms (floor) | other ms bf16 / {fmt} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        fr = {r["batch"]: r for r in f["rows"]}
        for r in a["rows"]:
            q = fr.get(r["batch"])
            if q is None:
                continue
            lines.append(
                f"| {r['batch']} | {r['step_s'] * 1e3:.3f} | {q['step_s'] * 1e3:.3f} | "
                f"{r['step_s'] / q['step_s']:.2f}x | {r['ceiling'][fmt]:.2f}x | "
                f"{r['linear_s'] * 1e3:.3f} ({r['linear_floor_s']['bf16'] * 1e3:.3f}) | "
                f"{q['linear_s'] * 1e3:.3f} ({r['linear_floor_s'][fmt] * 1e3:.3f}) | "
                f"{r['other_s'] * 1e3:.3f} / {q['other_s'] * 1e3:.3f} |"
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
    p.add_argument("--report", nargs="+", metavar="JSON", help="the bf16 run first, then others")
    ns = p.parse_args()
    if ns.report:
        if len(ns.report) < 2:
            p.error("--report takes the bf16 run's JSON and at least one quantized run's")
        print(report(*ns.report))
        return 0
    if not ns.model or not ns.out:
        p.error("MODEL and --out are required (or --report BF16_JSON QUANT_JSON...)")
    if any(not 1 <= b <= 512 for b in ns.batch_sizes):
        p.error(f"--batch-sizes must be in 1..512, got {ns.batch_sizes}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    res = measure(ns)
    Path(ns.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

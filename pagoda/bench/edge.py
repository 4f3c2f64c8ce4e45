"""`pagoda bench edge`: the small-GPU deployment comparison under a per-process memory cap.

Each model runs in its own process (`python -m pagoda.bench.edge --worker JOB`) capped with
`torch.cuda.set_per_process_memory_fraction` at `--memory-cap-gib`, `gpu_memory_utilization`
scaled to the cap, and optionally `PAGODA_EMULATE_CAPABILITY` (`--emulate-capability 8.9`) so
the kernel registries pick what an RTX 4070 / Jetson would run. Per model: weights, KV cache,
load time, TTFT with one image, decode tok/s at each batch size, and N concurrent large-image
requests (which must not run out of memory). Writes `edge.json` and `edge.md` to `--out`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "benchmarks/configs/qwen2.5-vl-3b.json"
QUESTION = "이 사진에 무엇이 보이나요? 한 문장으로 답하세요."  # the user's Korean questions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "models",
        nargs="*",
        help="models to compare (default: the Qwen2.5-VL-3B shape, bf16 and :w4a16)",
    )
    p.add_argument("--out", required=True, help="directory for edge.json and edge.md")
    p.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/qwen2.5-tokenizer"))
    p.add_argument("--memory-cap-gib", type=float, default=12.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="of the cap")
    p.add_argument("--emulate-capability", default=None, help="e.g. 8.9 (RTX 4070), 8.7 (Orin)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="one KV cache type for all models, or one per model, comma-separated "
        "(auto | fp8 | fp8_e4m3 | fp8_e5m2): W4A16 + FP8-KV rows beside the others",
    )
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--image-size", default="1280x720", help="TTFT image, WIDTHxHEIGHT")
    p.add_argument("--concurrent", type=int, default=8, help="concurrent image requests")
    p.add_argument("--concurrent-image-size", default="1920x1080")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--timeout-s", type=float, default=1800)


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"image size {text!r}: use WIDTHxHEIGHT, e.g. 1280x720") from None
    return w, h


def _image_url(width: int, height: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)  # a new image every call: no prefix or encoder cache hit
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(width: int, height: int, seed: int) -> list[dict[str, Any]]:
    url = _image_url(width, height, seed)
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One model, in this process: cap, engine, measurements."""
    import torch

    from pagoda import LLM, SamplingParams

    util = job["gpu_memory_utilization"]
    cap_bytes = int(job["memory_cap_gib"] * 2**30)
    on_cuda = job["device"] != "cpu" and torch.cuda.is_available()
    if on_cuda:
        total = torch.cuda.mem_get_info()[1]
        fraction = min(1.0, cap_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        util = util * fraction  # of the device's total, as the engine reads it
    t0 = time.perf_counter()
    llm = LLM(
        job["model"],
        tokenizer=job["tokenizer"],
        dtype=job["dtype"],
        device=job["device"],
        max_model_len=job["max_model_len"],
        gpu_memory_utilization=util,
        limit_mm_per_prompt={"image": 1},
        enforce_eager=job["enforce_eager"],
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
        print_memory_report=False,
    )
    startup = time.perf_counter() - t0
    report = llm.memory_report()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    w, h = job["image_size"]
    ttfts = []
    for i in range(job["iters"] + 1):  # the first is a warm-up
        start = time.perf_counter()
        llm.chat(_chat(w, h, 1000 + i), greedy, use_tqdm=False)
        if i:
            ttfts.append(time.perf_counter() - start)
    decode = {}
    for bs in job["batch_sizes"]:
        decode[str(bs)] = _decode_rate(llm, bs, job["output_len"])
    cw, ch = job["concurrent_image_size"]
    conversations = [_chat(cw, ch, 2000 + i) for i in range(job["concurrent"])]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    concurrent: dict[str, Any] = {"requests": job["concurrent"], "size": [cw, ch]}
    start = time.perf_counter()
    try:
        outs = llm.chat(conversations, params, use_tqdm=False)
        concurrent.update(ok=True, answered=sum(1 for o in outs if o.outputs[0].token_ids))
    except torch.OutOfMemoryError as e:  # the one failure this run exists to rule out
        concurrent.update(ok=False, error=str(e).splitlines()[0])
    concurrent["wall_s"] = time.perf_counter() - start
    result = {
        "model": job["model"],
        "kv_cache_dtype": job.get("kv_cache_dtype", "auto"),
        "device": report.device,
        "memory_cap_gib": job["memory_cap_gib"] if on_cuda else None,
        "emulated_capability": job.get("emulate_capability"),
        "weights_gib": report.weights_bytes / 2**30,
        "kv_cache_gib": report.kv_cache_bytes / 2**30,
        "kv_tokens": report.kv_token_capacity,
        "load_time_s": report.load_time_s,
        "startup_s": startup,
        "triton_kernels_compiled": report.triton_kernels_compiled,
        "ttft_image_s": statistics.median(ttfts),
        "image_size": [w, h],
        "decode_tok_s": decode,
        "concurrent_images": concurrent,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
        "memory_report": report.to_dict(),
    }
    llm.shutdown()
    return result


def _decode_rate(llm: Any, batch: int, output_len: int) -> float:
    """Tokens per second once every request of the batch has its first token."""
    from pagoda import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = engine.next_request_id()
        engine.add_request(rid, [100 + i, 200, 300, 400], params, final_only=True)
        ids.append(rid)
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None and all(
            len(engine._parents[r].children[0].request.output_token_ids) >= 1
            for r in ids
            if r in engine._parents
        ):
            first = time.perf_counter()
    end = time.perf_counter()
    return batch * (output_len - 1) / max(end - (first or end), 1e-9)


def _table(results: list[dict[str, Any]]) -> str:
    names = [
        Path(r["model"].replace("config:", "")).name
        + ("" if r.get("kv_cache_dtype", "auto") == "auto" else f" + {r['kv_cache_dtype']} KV")
        for r in results
    ]
    rows = [
        ("weights GiB", lambda r: f"{r['weights_gib']:.2f}"),
        ("KV cache GiB", lambda r: f"{r['kv_cache_gib']:.2f}"),
        ("KV tokens", lambda r: f"{r['kv_tokens']:,}"),
        ("load time s", lambda r: f"{r['load_time_s']:.1f}"),
        ("start-up s", lambda r: f"{r['startup_s']:.1f}"),
        ("TTFT, one image s", lambda r: f"{r['ttft_image_s']:.3f}"),
    ]
    for bs in results[0]["decode_tok_s"]:
        rows.append((f"decode tok/s, batch {bs}", lambda r, b=bs: f"{r['decode_tok_s'][b]:.1f}"))
    rows.append(
        (
            "concurrent images",
            lambda r: (
                ("ok" if r["concurrent_images"]["ok"] else "OOM")
                + f" ({r['concurrent_images']['requests']})"
            ),
        )
    )
    head = "| metric | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    return head + "\n".join(
        f"| {label} | " + " | ".join(fn(r) for r in results) + " |" for label, fn in rows
    )


def main(ns: argparse.Namespace) -> int:
    from pagoda.bench.compare import kv_cache_dtypes

    models = ns.models or [f"config:{DEFAULT_CONFIG}", f"config:{DEFAULT_CONFIG}:w4a16"]
    kv_dtypes = kv_cache_dtypes(ns.kv_cache_dtype, len(models))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    base = {
        "tokenizer": ns.tokenizer,
        "memory_cap_gib": ns.memory_cap_gib,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "emulate_capability": ns.emulate_capability,
        "device": ns.device,
        "dtype": ns.dtype,
        "max_model_len": ns.max_model_len,
        "image_size": _size(ns.image_size),
        "concurrent": ns.concurrent,
        "concurrent_image_size": _size(ns.concurrent_image_size),
        "batch_sizes": [int(b) for b in ns.batch_sizes.split(",")],
        "output_len": ns.output_len,
        "iters": ns.iters,
        "enforce_eager": ns.enforce_eager,
    }
    env = dict(os.environ)
    if ns.emulate_capability:
        env["PAGODA_EMULATE_CAPABILITY"] = ns.emulate_capability
    results = []
    for i, model in enumerate(models):
        job_file = out / f"job{i}.json"
        res_file = out / f"result{i}.json"
        job_file.write_text(json.dumps({**base, "model": model, "kv_cache_dtype": kv_dtypes[i]}))
        cmd = [sys.executable, "-m", "pagoda.bench.edge", "--worker", str(job_file), str(res_file)]
        print(f"edge: {model}", file=sys.stderr)
        proc = subprocess.run(cmd, env=env, timeout=ns.timeout_s)
        if proc.returncode != 0:
            raise ValueError(f"the run of {model} failed (exit {proc.returncode}); see above")
        results.append(json.loads(res_file.read_text()))
    (out / "edge.json").write_text(json.dumps(results, indent=2))
    table = _table(results)
    (out / "edge.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["concurrent_images"]["ok"] for r in results) else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        result = run_job(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        parser = argparse.ArgumentParser(prog="python -m pagoda.bench.edge")
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))

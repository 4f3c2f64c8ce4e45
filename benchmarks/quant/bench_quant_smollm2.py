"""Acceptance 2: W4A16 g64 on the embedded SmolLM2-135M: RTN vs pagoda GPTQ vs llmcompressor.

Steps (each skipped when its output exists in --work): calibration / held-out text from
python3-doc (prepare_python_docs.py), pagoda RTN and GPTQ (`pagoda.quantizer.quantize`), the
llmcompressor baseline on the same samples (llmcompressor_baseline.py, run with --lc-python),
then perplexity of the float model and the three checkpoints on the same held-out tokens.
Usage: python benchmarks/quant/bench_quant_smollm2.py --work /tmp/qbench --lc-python PY
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--lc-python", default=None, help="python with llmcompressor installed")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--out", default=str(HERE.parents[0] / "results" / "quant_smollm2_cpu.json")
    )
    ns = parser.parse_args()

    from pagoda.bench.perplexity import evaluate
    from pagoda.model_files import default_model_path
    from pagoda.quantizer import quantize

    work = Path(ns.work)
    work.mkdir(parents=True, exist_ok=True)
    docs = work / "pydocs"
    if not (docs / "calib.txt").is_file():
        subprocess.run(
            [sys.executable, str(HERE / "prepare_python_docs.py"), str(docs)], check=True
        )
    calib, heldout = docs / "calib.txt", docs / "heldout.txt"
    model = default_model_path()
    common = dict(
        scheme="W4A16",
        group_size=ns.group_size,
        dataset=str(calib),
        num_samples=ns.num_samples,
        max_seq_len=ns.max_seq_len,
        seed=0,
        dampening=0.01,
        block_size=128,
        device="cpu",
        dtype="float32",
    )
    runs: dict[str, dict] = {}
    for name, method, actorder in (("rtn", "rtn", None), ("pagoda_gptq", "gptq", "static")):
        out = work / name
        info_file = work / f"{name}.json"
        if not info_file.is_file():
            kwargs = dict(common)
            if method == "rtn":
                kwargs["dataset"] = None  # RTN needs no data (its time excludes calibration)
            start = time.perf_counter()
            report = quantize(model, out, method=method, actorder=actorder, **kwargs)
            info = {"seconds": time.perf_counter() - start, "report": report.to_dict()}
            info_file.write_text(json.dumps(info, indent=2))
        runs[name] = json.loads(info_file.read_text())
    lc_out = work / "llmcompressor_gptq"
    if not (lc_out / "llmcompressor_run.json").is_file() and ns.lc_python:
        subprocess.run(
            [
                ns.lc_python,
                str(HERE / "llmcompressor_baseline.py"),
                str(lc_out),
                "--dataset",
                str(calib),
                "--num-samples",
                str(ns.num_samples),
                "--max-seq-len",
                str(ns.max_seq_len),
                "--group-size",
                str(ns.group_size),
            ],
            check=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())),
            },
        )
    if (lc_out / "llmcompressor_run.json").is_file():
        runs["llmcompressor_gptq"] = json.loads((lc_out / "llmcompressor_run.json").read_text())

    results = {}
    models = {
        "float32 (GGUF dequantized)": model,
        "rtn": work / "rtn",
        "pagoda_gptq": work / "pagoda_gptq",
        "llmcompressor_gptq": lc_out,
    }
    for label, path in models.items():
        if label != "float32 (GGUF dequantized)" and not Path(path).is_dir():
            continue
        cache = work / f"eval_{label.split(' ')[0]}_{ns.eval_tokens}_{ns.window}.json"
        if not cache.is_file():
            ppl = evaluate(str(path), str(heldout), ns.eval_tokens, ns.window, ns.window,
                           device="cpu", dtype="float32")  # fmt: skip
            cache.write_text(json.dumps(asdict(ppl), indent=2))
        entry = json.loads(cache.read_text())
        if Path(path).is_dir():
            entry["checkpoint_bytes"] = _dir_bytes(Path(path))
        results[label] = entry
        print(f"{label:28s} ppl {entry['perplexity']:.3f}  ({entry['num_scored']} tokens, "
              f"{entry['tokens_sha256']})", flush=True)  # fmt: skip

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1, dequantized to float32)",
        "settings": {
            **{k: v for k, v in common.items() if k != "dataset"},
            "calibration": "python3-doc library/*.html, text",
            "heldout": "python3-doc tutorial/ + reference/*.html",
            "eval_tokens": ns.eval_tokens,
            "window": ns.window,
            "stride": ns.window,
        },
        "quantization_seconds": {k: v.get("seconds") for k, v in runs.items()},
        "perplexity": {k: v["perplexity"] for k, v in results.items()},
        "evals": results,
        "runs": runs,
    }
    Path(ns.out).write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps(
            {
                "perplexity": record["perplexity"],
                "quantization_seconds": record["quantization_seconds"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

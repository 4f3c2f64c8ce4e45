"""Issue 17 acceptance 2: AWQ W4A16_ASYM on the embedded SmolLM2-135M, pagoda vs llmcompressor.

Steps (each skipped when its output exists in --work): calibration / held-out text from
python3-doc (prepare_python_docs.py); pagoda `--method awq`, asymmetric RTN
and llmcompressor's AWQModifier (llmcompressor_awq_baseline.py, run with --lc-python) on the
same samples; perplexity of the float model and every checkpoint on the same held-out tokens;
the JSON record once every result is there. `--only NAME` runs one step (its quantization and
its perplexity), so that the steps can run as parallel processes, one thread each.
Usage: python benchmarks/quant/bench_awq_smollm2.py --work /tmp/awqbench --lc-python PY
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
STEPS = ("float32", "pagoda_awq", "rtn_asym", "llmcompressor_awq")
_METHODS = {"pagoda_awq": "awq", "rtn_asym": "rtn"}


def _pagoda_run(name: str, work: Path, model: str, method: str, common: dict) -> dict:
    from pagoda.quantizer import quantize

    info_file = work / f"{name}.json"
    if not info_file.is_file():
        kwargs = dict(common)
        if method == "rtn":
            kwargs["dataset"] = None  # RTN reads no data
        start = time.perf_counter()
        report = quantize(model, work / name, method=method, **kwargs)
        info = {"seconds": time.perf_counter() - start, "report": report.to_dict()}
        info_file.write_text(json.dumps(info, indent=2))
    return json.loads(info_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--lc-python", default=None, help="python with llmcompressor installed")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--calib-bytes",
        type=int,
        default=0,
        help="calibrate on this many leading bytes of calib.txt (whole lines; 0: all): the "
        "samples are drawn from a tokenised stream, and tokenising all 5 MB costs minutes",
    )
    parser.add_argument("--only", default=None, choices=STEPS, help="run this step alone")
    parser.add_argument(
        "--out", default=str(HERE.parents[0] / "results" / "quant_awq_smollm2_cpu.json")
    )
    ns = parser.parse_args()

    from pagoda.bench.perplexity import evaluate
    from pagoda.model_files import default_model_path

    work = Path(ns.work)
    work.mkdir(parents=True, exist_ok=True)
    docs = work / "pydocs"
    if not (docs / "calib.txt").is_file():
        subprocess.run(
            [sys.executable, str(HERE / "prepare_python_docs.py"), str(docs)], check=True
        )
    calib, heldout = docs / "calib.txt", docs / "heldout.txt"
    if ns.calib_bytes:
        text = calib.read_text(encoding="utf-8")[: ns.calib_bytes]
        calib = docs / f"calib_{ns.calib_bytes}.txt"
        if not calib.is_file():
            calib.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
    model = default_model_path()
    common = dict(
        scheme="W4A16_ASYM",
        group_size=ns.group_size,
        dataset=str(calib),
        num_samples=ns.num_samples,
        max_seq_len=ns.max_seq_len,
        seed=0,
        device="cpu",
        dtype="float32",
        actorder=None,
    )
    lc_out = work / "llmcompressor_awq"
    steps = [ns.only] if ns.only else list(STEPS)
    runs: dict[str, dict] = {}
    results: dict[str, dict] = {}
    for step in steps:
        if step in _METHODS:
            runs[step] = _pagoda_run(step, work, model, _METHODS[step], common)
        elif step == "llmcompressor_awq":
            if not (lc_out / "llmcompressor_run.json").is_file():
                if not ns.lc_python:
                    continue
                subprocess.run(
                    [
                        ns.lc_python,
                        str(HERE / "llmcompressor_awq_baseline.py"),
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
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            runs[step] = json.loads((lc_out / "llmcompressor_run.json").read_text())
        path = (
            model if step == "float32" else lc_out if step == "llmcompressor_awq" else work / step
        )
        cache = work / f"eval_{step}_{ns.eval_tokens}_{ns.window}.json"
        if not cache.is_file():
            ppl = evaluate(str(path), str(heldout), ns.eval_tokens, ns.window, ns.window,
                           device="cpu", dtype="float32")  # fmt: skip
            cache.write_text(json.dumps(asdict(ppl), indent=2))
        results[step] = json.loads(cache.read_text())
        entry = results[step]
        print(f"{step:20s} ppl {entry['perplexity']:.3f}  ({entry['num_scored']} tokens, "
              f"{entry['tokens_sha256']})", flush=True)  # fmt: skip
    if ns.only:
        return

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
            "calibration": "python3-doc library/*.html, text"
            + (f" (first {ns.calib_bytes} bytes)" if ns.calib_bytes else ""),
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
    summary = {k: record[k] for k in ("perplexity", "quantization_seconds")}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""The quantizer quality protocol on one model: float, RTN (asym, sym), pagoda and llmcompressor
GPTQ / AWQ.

Identical calibration samples (`pagoda quantize`'s draw from python3-doc library text, seed 0),
lm_head dense, held-out perplexity on python3-doc tutorial + reference text. Each step is skipped
when its output exists in --work; `--only STEP` runs one, `--steps A,B` records those.
Usage: python benchmarks/quant/bench_quantizer.py --work DIR [--model X.gguf] [--lc-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# step -> (method, scheme) for pagoda's runs; llmcompressor's run in their own venv.
PAGODA = {
    "rtn_asym": ("rtn", "W4A16_ASYM"),
    "rtn_sym": ("rtn", "W4A16"),
    "pagoda_gptq": ("gptq", "W4A16"),
    "pagoda_gptq_asym": ("gptq", "W4A16_ASYM"),
    "pagoda_awq": ("awq", "W4A16_ASYM"),
}
LLMC = {
    "llmcompressor_gptq": "llmcompressor_baseline.py",
    "llmcompressor_awq": "llmcompressor_awq_baseline.py",
}
STEPS = ("float32", *PAGODA, *LLMC)


def _cpu_seconds(who: int) -> float:
    """User + system CPU time (the machine may be shared: wall time alone overstates)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _pagoda_run(step: str, work: Path, model: str, common: dict) -> dict:
    from pagoda.quantizer import quantize

    info_file = work / f"{step}.json"
    if not info_file.is_file():
        method, scheme = PAGODA[step]
        kwargs = dict(common, scheme=scheme)
        if method == "rtn":
            kwargs["dataset"] = None  # RTN reads no data
        start, cpu = time.perf_counter(), _cpu_seconds(resource.RUSAGE_SELF)
        report = quantize(model, work / step, method=method, **kwargs)
        info = {
            "seconds": time.perf_counter() - start,
            "cpu_seconds": _cpu_seconds(resource.RUSAGE_SELF) - cpu,
            "report": report.to_dict(),
        }
        info_file.write_text(json.dumps(info, indent=2))
    return json.loads(info_file.read_text())


def _llmc_run(step: str, work: Path, model: str, calib: Path, ns) -> dict | None:
    out = work / step
    if not (out / "llmcompressor_run.json").is_file():
        if not ns.lc_python:
            return None
        argv = [ns.lc_python, str(HERE / LLMC[step]), str(out), "--model", model,
                "--dataset", str(calib), "--num-samples", str(ns.num_samples),
                "--max-seq-len", str(ns.max_seq_len),
                "--group-size", str(ns.group_size)]  # fmt: skip
        if step == "llmcompressor_gptq":
            argv += ["--actorder", "static"]
        cpu = _cpu_seconds(resource.RUSAGE_CHILDREN)
        threads = str(torch.get_num_threads())
        # pagoda (calibration draw, tokenizer) from this checkout, whatever the venv has
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(HERE.parents[1])}
        subprocess.run(argv, check=True, env=env)
        run = json.loads((out / "llmcompressor_run.json").read_text())
        run["cpu_seconds_process"] = _cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
        (out / "llmcompressor_run.json").write_text(json.dumps(run, indent=2))
    return json.loads((out / "llmcompressor_run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    parser.add_argument("--lc-python", default=None, help="python with llmcompressor installed")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument(
        "--calib-bytes", type=int, default=400000, help="leading bytes of calib.txt (0: all)"
    )
    parser.add_argument("--dtype", default="float32", help="checkpoint dtype (CPU: fp32 math)")
    parser.add_argument(
        "--eval-dtype", default="float32", help="dtype the checkpoints are scored in"
    )
    parser.add_argument("--only", default=None, choices=STEPS)
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="comma-separated steps of the record (default all)"
    )
    parser.add_argument("--out", default=None, help="the JSON record (default: WORK/record.json)")
    ns = parser.parse_args()

    from pagoda.bench.perplexity import evaluate
    from pagoda.model_files import default_model_path

    work = Path(ns.work)
    work.mkdir(parents=True, exist_ok=True)
    docs = work / "pydocs"
    if not (docs / "calib.txt").is_file():
        subprocess.run([sys.executable, str(HERE / "prepare_python_docs.py"), str(docs)],
                       check=True)  # fmt: skip
    calib, heldout = docs / "calib.txt", docs / "heldout.txt"
    if ns.calib_bytes:
        text = calib.read_text(encoding="utf-8")[: ns.calib_bytes]
        calib = docs / f"calib_{ns.calib_bytes}.txt"
        if not calib.is_file():
            calib.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
    model = ns.model or default_model_path()
    common = dict(group_size=ns.group_size, dataset=str(calib), num_samples=ns.num_samples,
                  max_seq_len=ns.max_seq_len, seed=0, device="cpu", dtype=ns.dtype,
                  actorder="static")  # fmt: skip
    runs: dict[str, dict] = {}
    results: dict[str, dict] = {}
    steps = ns.steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    for step in [ns.only] if ns.only else steps:
        if step in PAGODA:
            runs[step] = _pagoda_run(step, work, model, common)
        elif step in LLMC:
            run = _llmc_run(step, work, model, calib, ns)
            if run is None:
                continue
            runs[step] = run
        path = model if step == "float32" else str(work / step)
        cache = work / f"eval_{step}_{ns.eval_tokens}_{ns.window}_{ns.eval_dtype}.json"
        if not cache.is_file():
            ppl = evaluate(path, str(heldout), ns.eval_tokens, ns.window, ns.window,
                           device="cpu", dtype=ns.eval_dtype)  # fmt: skip
            cache.write_text(json.dumps(asdict(ppl), indent=2))
        results[step] = json.loads(cache.read_text())
        print(f"{step:20s} ppl {results[step]['perplexity']:.3f} "
              f"({results[step]['num_scored']} tokens)", flush=True)  # fmt: skip
    if ns.only:
        return
    ppl = {k: v["perplexity"] for k, v in results.items()}
    gap = {}
    for method, rtn in (("pagoda_gptq", "rtn_sym"), ("llmcompressor_gptq", "rtn_sym"),
                        ("pagoda_gptq_asym", "rtn_asym"),
                        ("pagoda_awq", "rtn_asym"), ("llmcompressor_awq", "rtn_asym")):  # fmt: skip
        if {method, rtn, "float32"} <= set(ppl):
            gap[method] = (ppl[rtn] - ppl[method]) / (ppl[rtn] - ppl["float32"])
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },  # fmt: skip
        "model": str(model),
        "settings": {
            **common,
            "eval_tokens": ns.eval_tokens,
            "window": ns.window,
            "eval_dtype": ns.eval_dtype,
            "calibration": f"python3-doc library/*.html text, first {ns.calib_bytes} B",
            "heldout": "python3-doc tutorial/ + reference/*.html",
        },  # fmt: skip
        "perplexity": ppl,
        "rtn_to_float_gap_closed": gap,
        "quantization_seconds": {k: v.get("seconds") for k, v in runs.items()},
        "evals": results,
        "runs": runs,
    }
    out = Path(ns.out) if ns.out else work / "record.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("perplexity", "rtn_to_float_gap_closed")}, indent=2))


if __name__ == "__main__":
    main()

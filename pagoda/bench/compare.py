"""`pagoda compare`: several model configurations side by side, measured by the engine itself.

Each configuration (and the optional transformers baseline) runs in a fresh subprocess
(`pagoda.bench.compare_worker`), so device memory and allocator peaks start clean. This module
validates the arguments (defaults sized for the device: `GPU_DEFAULTS` / `CPU_DEFAULTS`), runs
the workers one after another with a progress bar per phase, and hands the results to
`compare_report` for the table, the JSON and the plots. Each worker rewrites its result after
every measurement, so Ctrl-C / SIGTERM still leaves a report of what was measured, and
`--resume` (same `--out`) runs only what is missing. Torch is imported only to resolve "auto".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from pagoda.bench.compare_report import flat_values, metrics_for, ratios, write_report
from pagoda.bench.compare_worker import (
    BAR_PREFIX,
    ERROR_PREFIX,
    PROGRESS_PREFIX,
    CompareJob,
    standard_workload_lengths,
)

_DTYPE_SHORT = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
    "half": "fp16",
    "float": "fp32",
}
_LOG_TAIL = 12  # lines of a failed worker's log shown on the terminal

# Defaults by device: a GPU run measures the standard workload; on CPU the same run would take
# hours (a 135M model, 2 cores), so the CPU defaults fit two configurations of the embedded
# model in 5 minutes on 2 cores: a short speed probe (no throughput run), the held-out
# perplexity (21.7k tokens) and the greedy answers.
GPU_DEFAULTS = {
    "max_model_len": 4096,
    "prompt_len": 512,
    "output_len": 256,
    "batch_sizes": "1,8,64",
    "iters": 2,
    "throughput_requests": 256,
    "ppl_window": 512,
}
CPU_DEFAULTS = {
    "max_model_len": 512,
    "prompt_len": 64,
    "output_len": 16,
    "batch_sizes": "1",
    "iters": 1,
    "throughput_requests": 0,
    "ppl_window": 512,
}


def _default_help(key: str) -> str:
    return f"(default: {GPU_DEFAULTS[key]} on GPU, {CPU_DEFAULTS[key]} on CPU)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "models",
        nargs="+",
        metavar="MODEL_OR_CONFIG",
        help="model directory, .gguf file, config:PATH.json[:w4a16|:w8a16|:fp8] (random "
        "weights; w4a16-lm_head / w8a16-lm_head quantize an untied lm_head too; fp8: "
        "FP8_DYNAMIC), or 'default' "
        "(the embedded SmolLM2); the first one is the reference for ratios",
    )
    p.add_argument(
        "--labels",
        default=None,
        help="comma-separated names of the configurations (default: from the model)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="one dtype for all, or one per configuration, comma-separated "
        "(auto | float32 | float16 | bfloat16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="one KV cache type for all, or one per configuration, comma-separated "
        "(auto | fp8 | fp8_e4m3 | fp8_e5m2): FP8-KV rows beside the model-dtype ones",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=None, help=_default_help("max_model_len"))
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine concurrency (default: 256, or the largest batch size if more)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--prompt-len", type=int, default=None, help=_default_help("prompt_len"))
    p.add_argument("--output-len", type=int, default=None, help=_default_help("output_len"))
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="decode batch sizes, comma-separated " + _default_help("batch_sizes"),
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="runs per TTFT / decode figure (median) " + _default_help("iters"),
    )
    p.add_argument(
        "--throughput-requests",
        type=int,
        default=None,
        help="requests of the standard throughput workload, 0 to skip "
        + _default_help("throughput_requests"),
    )
    p.add_argument(
        "--ppl-text",
        default=None,
        help="a UTF-8 text file for perplexity (default: 21.7k tokens of the Python tutorial "
        "shipped with pagoda, held out from calibration; pass in-domain text for your data)",
    )
    p.add_argument(
        "--ppl-window",
        type=int,
        default=None,
        help="perplexity window in tokens (non-overlapping; capped at max-model-len) "
        + _default_help("ppl_window"),
    )
    p.add_argument(
        "--baseline",
        choices=["transformers", "none"],
        default="none",
        help="add transformers (same shape and dtype, random weights) as a column",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads per worker (default: torch's choice); on a shared machine 1 "
        "avoids OpenMP spin-waits that slow every step several-fold",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed per configuration (default: no limit)",
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: ./compare-YYYYmmdd-HHMMSS)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in --out: finished configurations are kept, and "
        "the interrupted one keeps its finished measurements",
    )


def apply_device_defaults(ns: argparse.Namespace) -> str:
    """Fill the options left unset with the defaults of the device the run will use."""
    device = ns.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(ns, key, None) is None:
            setattr(ns, key, value)
    return device


# ---------------------------------------------------------------------- validation


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    parts = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        sizes = tuple(int(t) for t in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(
            f"--batch-sizes must be a comma-separated list of positive integers, got {text!r}"
        )
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes has a repeated value: {text!r}")
    return tuple(sorted(sizes))


def _per_config(text: str | None, n: int, flag: str) -> list[str | None]:
    if text is None:
        return [None] * n
    parts = [t.strip() for t in text.split(",")]
    if len(parts) == 1:
        return parts * n
    if len(parts) != n:
        raise ValueError(
            f"{flag} has {len(parts)} values for {n} configurations; give one "
            "value for all, or one per configuration"
        )
    return parts


def kv_cache_dtypes(text: str | None, n: int) -> list[str]:
    """`--kv-cache-dtype`: one value for all n configurations or one each, validated."""
    kv_dtypes = [k or "auto" for k in _per_config(text, n, "--kv-cache-dtype")]
    for k in kv_dtypes:
        if k not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(
                f"--kv-cache-dtype {k!r} is not supported; use auto, fp8, fp8_e4m3 or fp8_e5m2"
            )
    return kv_dtypes


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


def _default_label(model: str, dtype: str) -> str:
    from pagoda.model_files import resolve_model

    source = resolve_model(None if model == "default" else model)
    label = source.name
    if source.quant_override:
        label += f" {source.quant_override}"
    if dtype != "auto":
        label += f" {_DTYPE_SHORT.get(dtype, dtype)}"
    return label


def build_jobs(ns: argparse.Namespace) -> tuple[list[CompareJob], dict[str, Any]]:
    """Check every argument (one clear error for the first bad one) and build the jobs."""
    from pagoda.config import normalize_dtype
    from pagoda.model_files import resolve_model

    apply_device_defaults(ns)
    models = list(ns.models)
    sources = []
    for m in models:
        # FileNotFoundError / ValueError with the model's name: the CLI prints it as one line
        sources.append(resolve_model(None if m == "default" else m))
    batch_sizes = parse_batch_sizes(ns.batch_sizes)
    dtypes = [d or "auto" for d in _per_config(ns.dtype, len(models), "--dtype")]
    for d in dtypes:
        normalize_dtype(d)
    kv_dtypes = kv_cache_dtypes(ns.kv_cache_dtype, len(models))
    if ns.device not in ("auto", "cpu", "cuda") and not str(ns.device).startswith("cuda:"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {ns.device!r}")
    if not 0.0 < ns.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}"
        )
    for name in ("max_model_len", "prompt_len", "iters", "ppl_window"):
        _positive(name.replace("_", "-"), getattr(ns, name))
    if ns.output_len < 2:
        raise ValueError(
            f"--output-len must be >= 2 (decode needs a second token), got {ns.output_len}"
        )
    if ns.prompt_len + ns.output_len > ns.max_model_len:
        raise ValueError(
            f"--prompt-len {ns.prompt_len} + --output-len {ns.output_len} exceeds "
            f"--max-model-len {ns.max_model_len}"
        )
    if ns.throughput_requests < 0 or ns.throughput_requests > 256:
        raise ValueError(
            f"--throughput-requests must be in [0, 256] (the standard workload has "
            f"256 requests), got {ns.throughput_requests}"
        )
    if ns.max_num_seqs is not None:
        _positive("max-num-seqs", ns.max_num_seqs)
    max_num_seqs = ns.max_num_seqs or max(256, max(batch_sizes))
    if max(batch_sizes) > max_num_seqs:
        raise ValueError(
            f"--batch-sizes up to {max(batch_sizes)} need --max-num-seqs >= "
            f"{max(batch_sizes)}, got {max_num_seqs}"
        )
    ppl_text = None
    if ns.ppl_text is not None:
        path = Path(ns.ppl_text)
        if not path.is_file():
            raise FileNotFoundError(f"--ppl-text {ns.ppl_text!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--ppl-text {ns.ppl_text!r} is not UTF-8 text ({e})") from None
        if not text.strip():
            raise ValueError(f"--ppl-text {ns.ppl_text!r} is empty")
        ppl_text = str(path.resolve())
    if ns.cpu_threads is not None:
        _positive("cpu-threads", ns.cpu_threads)
    if ns.timeout is not None and ns.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {ns.timeout}")

    labels = _per_config(ns.labels, len(models), "--labels") if ns.labels else None
    if labels is None:
        labels = [_default_label(m, d) for m, d in zip(models, dtypes, strict=True)]
    labels = _dedupe([str(lb) for lb in labels])

    common = dict(
        device=ns.device,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        enforce_eager=ns.enforce_eager,
        prompt_len=ns.prompt_len,
        output_len=ns.output_len,
        batch_sizes=batch_sizes,
        iters=ns.iters,
        cpu_threads=ns.cpu_threads,
    )
    jobs = [
        CompareJob(
            label=lb,
            model=m,
            dtype=d,
            kv_cache_dtype=kv,
            throughput_requests=ns.throughput_requests,
            ppl_text=ppl_text,
            ppl_window=ns.ppl_window,
            **common,
        )
        for lb, m, d, kv in zip(labels, models, dtypes, kv_dtypes, strict=True)
    ]
    if ns.baseline == "transformers":
        seen: set[tuple] = set()
        for job, src in zip(list(jobs), sources, strict=True):
            # One baseline per model shape and dtype: a quantized checkpoint shares its base
            # model's (transformers runs the unquantized shape).
            key = (_shape_key(src), job.dtype)
            if key in seen:
                continue
            seen.add(key)
            dshort = "" if job.dtype == "auto" else f" {_DTYPE_SHORT.get(job.dtype, job.dtype)}"
            jobs.append(
                CompareJob(
                    label=f"transformers ({src.name}{dshort})",
                    model=job.model,
                    engine="transformers",
                    dtype=job.dtype,
                    throughput_requests=0,
                    **common,
                )
            )
        # the baseline labels must stay distinct from the configurations'
        for i, lb in enumerate(_dedupe([j.label for j in jobs])):
            if jobs[i].label != lb:
                jobs[i] = CompareJob.from_dict({**jobs[i].to_dict(), "label": lb})

    lo, hi, _, _ = standard_workload_lengths(ns.max_model_len)
    settings = {
        "models": models,
        "labels": [j.label for j in jobs],
        "dtypes": dtypes,
        "device": ns.device,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "max_model_len": ns.max_model_len,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": ns.enforce_eager,
        "prompt_len": ns.prompt_len,
        "output_len": ns.output_len,
        "batch_sizes": list(batch_sizes),
        "iters": ns.iters,
        "throughput_requests": ns.throughput_requests,
        "throughput_len_range": [lo, hi],
        "ppl_text": ns.ppl_text,  # as given (the workers get the absolute path)
        "ppl_window": ns.ppl_window,
        "baseline": ns.baseline,
        "cpu_threads": ns.cpu_threads,
    }
    return jobs, settings


def _shape_key(source: Any) -> tuple:
    from pagoda.model_files import load_hf_config

    cfg = load_hf_config(source)
    text = getattr(cfg, "text_config", None) or cfg
    names = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size")  # fmt: skip
    return tuple(getattr(text, n, None) for n in names)


def _dedupe(labels: list[str]) -> list[str]:
    out: list[str] = []
    for lb in labels:
        name, k = lb, 2
        while name in out:
            name, k = f"{lb} #{k}", k + 1
        out.append(name)
    return out


def command_line(ns: argparse.Namespace) -> str:
    """The invocation, rebuilt from the parsed arguments (for the report)."""
    args = ["pagoda", "compare", *ns.models]
    # every value is written out, device defaults included: the line reruns the same thing
    defaults = {
        "labels": None,
        "dtype": "auto",
        "device": "auto",
        "gpu_memory_utilization": 0.85,
        "max_num_seqs": None,
        "enforce_eager": False,
        "ppl_text": None,
        "baseline": "none",
        "cpu_threads": None,
        "timeout": None,
        "out": None,
        "resume": False,
    }
    for key in GPU_DEFAULTS:
        defaults.setdefault(key, object())
    for key, default in defaults.items():
        value = getattr(ns, key)
        if value == default:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return shlex.join(args)


# ---------------------------------------------------------------------- running


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "config"


def _paths(out_dir: Path, index: int, job: CompareJob) -> tuple[Path, Path, Path]:
    name = f"{index:02d}-{_slug(job.label)}"
    return (
        out_dir / "jobs" / f"{name}.json",
        out_dir / "jobs" / f"{name}.result.json",
        out_dir / "logs" / f"{name}.log",
    )


def read_result(path: Path) -> dict[str, Any] | None:
    """A worker's result file (complete or not), None when absent or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


class _PhaseBars:
    """One tqdm bar per phase of a worker (`@@bar done total phase` lines), on stderr."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.phase: str | None = None
        self.bar: Any = None

    def update(self, line: str) -> None:
        from tqdm import tqdm

        done_s, total_s, phase = line.split(" ", 2)
        done, total = int(done_s), int(total_s)
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.bar = tqdm(total=total, desc=f"{self.tag} · {phase}", file=sys.stderr, leave=True)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_job(
    job: CompareJob,
    index: int,
    total: int,
    out_dir: Path,
    timeout: float | None,
    resume: bool = False,
) -> tuple[dict[str, Any] | None, str | None]:
    """Run one worker; stream its progress; (result, None) or (None, error line)."""
    (out_dir / "jobs").mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = _paths(out_dir, index, job)
    tag = f"[{index}/{total}] {job.label}"
    if resume:
        previous = read_result(result_path)
        if previous is not None and previous.get("complete"):
            print(f"{tag} · kept from the previous run (--resume)", file=sys.stderr)
            return previous, None
    else:
        result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job.to_dict(), indent=2) + "\n", encoding="utf-8")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if job.cpu_threads:
        # read by the OpenMP runtime at start-up, before torch.set_num_threads in the worker
        env["OMP_NUM_THREADS"] = str(job.cpu_threads)
    cmd = [
        sys.executable,
        "-m",
        "pagoda.bench.compare_worker",
        "--job",
        str(job_path),
        "--out",
        str(result_path),
        *(["--resume"] if resume else []),
    ]
    t0 = time.perf_counter()
    print(f"{tag} · starting ({job.engine}, {job.model})", file=sys.stderr, flush=True)
    error = None
    timed_out = threading.Event()
    bars = _PhaseBars(tag)
    with open(log_path, "a" if resume else "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env=env)

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith(BAR_PREFIX):
                    bars.update(line[len(BAR_PREFIX) :].rstrip("\n"))
                    continue
                log.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    bars.close()
                    msg = line[len(PROGRESS_PREFIX) :].rstrip()
                    print(
                        f"{tag} · {msg}  [{time.perf_counter() - t0:.0f} s]",
                        file=sys.stderr,
                        flush=True,
                    )
                elif line.startswith(ERROR_PREFIX):
                    error = line[len(ERROR_PREFIX) :].strip()
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            bars.close()
            if timer:
                timer.cancel()
    elapsed = time.perf_counter() - t0
    if timed_out.is_set():
        error = f"timed out after {timeout:.0f} s (see {log_path})"
    elif rc != 0 or not result_path.is_file():
        error = error or f"worker exited with code {rc} (see {log_path})"
    if error:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-_LOG_TAIL:]
        print(f"{tag} · FAILED after {elapsed:.0f} s: {error}", file=sys.stderr)
        for t in tail:
            print(f"    | {t}", file=sys.stderr)
        return None, error
    print(f"{tag} · done in {elapsed:.0f} s", file=sys.stderr, flush=True)
    return json.loads(result_path.read_text(encoding="utf-8")), None


def check_resume(jobs: list[CompareJob], out_dir: Path) -> None:
    """--resume needs the same configurations and settings as the run it continues."""
    if not (out_dir / "jobs").is_dir():
        raise ValueError(f"--resume: {out_dir} has no previous run (no jobs/ directory)")
    for i, job in enumerate(jobs):
        job_path = _paths(out_dir, i + 1, job)[0]
        if not job_path.is_file():
            continue  # not reached before the interruption
        before = json.loads(job_path.read_text(encoding="utf-8"))
        changed = sorted(k for k, v in job.to_dict().items() if before.get(k) != v)
        if changed:
            raise ValueError(
                f"--resume: {job.label} was run with other settings ({', '.join(changed)}); "
                "pass the same arguments, or start a new --out"
            )


def _git_revision() -> str | None:
    """HEAD of the checkout pagoda runs from ("-dirty" with local changes), if it is one."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            capture_output=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty.strip() else "")


def build_report(
    jobs: list[CompareJob],
    outcomes: list[tuple[dict | None, str | None]],
    settings: dict[str, Any],
    command: str,
) -> dict[str, Any]:
    metrics = metrics_for(settings)
    configs = []
    for job, (result, error) in zip(jobs, outcomes, strict=True):
        entry: dict[str, Any] = {
            "label": job.label,
            "engine": job.engine,
            "model": job.model,
            "dtype": job.dtype,
            "status": "ok" if result else "failed",
        }
        if result is None:
            entry.update(error=error, values={}, ratios={}, result={})
        else:
            entry.update(
                dtype=result.get("dtype", job.dtype),
                device=result.get("device"),
                values=flat_values(result, metrics),
                result=result,
            )
            if not result.get("complete", True):
                entry["interrupted"] = True
        configs.append(entry)
    ok = [c for c in configs if c["status"] == "ok"]
    ref = next((c for c in ok if c["engine"] == "pagoda"), ok[0] if ok else None)
    for c in ok:
        if ref is not None:
            c["values"].update(greedy_agreement(c["result"], ref["result"]))
    for c in configs:
        c["ratios"] = ratios(c["values"], ref["values"]) if ref and c["values"] else {}
    first = ok[0]["result"] if ok else {}
    settings = dict(settings, device_resolved=first.get("device", settings["device"]))
    return {
        "benchmark": "compare",
        "command": command,
        "git": _git_revision(),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "env": first.get("env", {}),
        "settings": settings,
        "reference": ref["label"] if ref else None,
        "metrics": [vars(m) for m in metrics],
        "configs": configs,
    }


def greedy_agreement(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    """How closely a configuration's greedy answers follow the reference's: the share of
    answers that are identical, and the share of the reference's tokens reproduced (each
    answer counts its common prefix with the reference's answer)."""
    mine = (result.get("greedy") or {}).get("token_ids")
    theirs = (ref.get("greedy") or {}).get("token_ids")
    if not mine or not theirs or len(mine) != len(theirs):
        return {"greedy_same": None, "greedy_tokens": None}
    same = sum(a == b for a, b in zip(mine, theirs, strict=True))
    prefix = 0
    for a, b in zip(mine, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
    total = sum(len(b) for b in theirs)
    return {
        "greedy_same": same / len(theirs),
        "greedy_tokens": prefix / total if total else None,
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(ns: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    jobs, settings = build_jobs(ns)
    if ns.resume and ns.out is None:
        raise ValueError("--resume needs --out DIR, the directory of the run to continue")
    out_dir = Path(ns.out or f"compare-{datetime.now():%Y%m%d-%H%M%S}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} exists and is not a directory")
    if ns.resume:
        check_resume(jobs, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(ns)
    print(f"pagoda compare: {len(jobs)} run(s), results in {out_dir}/", file=sys.stderr)
    outcomes: list[tuple[dict | None, str | None]] = []
    on_main = threading.current_thread() is threading.main_thread()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running worker is killed
    # rather than left holding the GPU, and what it measured is reported.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main else None
    try:
        for i, job in enumerate(jobs):
            outcomes.append(run_job(job, i + 1, len(jobs), out_dir, ns.timeout, ns.resume))
            if i + 1 < len(jobs):
                # a partial report after every configuration (plots are drawn at the end)
                partial = build_report(jobs[: i + 1], outcomes, settings, command)
                if partial["reference"] is not None:
                    write_report(partial, out_dir, plots=False)
    except (KeyboardInterrupt, SystemExit) as stop:
        _report_interrupted(jobs, outcomes, settings, command, out_dir, ns)
        if isinstance(stop, SystemExit):
            raise
        return 130
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    report = build_report(jobs, outcomes, settings, command)
    report["wall_s"] = time.perf_counter() - t_start
    if report["reference"] is None:
        write_report(report, out_dir)
        raise ValueError(f"every configuration failed; see the logs in {out_dir / 'logs'}")
    md = write_report(report, out_dir)
    print(md.split("\n![", 1)[0].rstrip())  # the table and notes, without the image links
    print(
        f"\npagoda compare: {len(jobs)} configuration(s) in "
        f"{time.perf_counter() - t_start:.0f} s (wall, plots included)"
    )
    print(
        f"\nwrote {out_dir / 'report.md'}, report.json and "
        f"{', '.join(report['plots']) or 'no plots'}",
        file=sys.stderr,
    )
    return 1 if any(c["status"] != "ok" for c in report["configs"]) else 0


def _report_interrupted(
    jobs: list[CompareJob],
    outcomes: list[tuple[dict | None, str | None]],
    settings: dict[str, Any],
    command: str,
    out_dir: Path,
    ns: argparse.Namespace,
) -> None:
    """The report of what finished, the interrupted configuration's measurements included."""
    done = list(outcomes)
    if len(done) < len(jobs):
        partial = read_result(_paths(out_dir, len(done) + 1, jobs[len(done)])[1])
        if partial is not None:
            done.append((partial, None))
    kept = [(j, o) for j, o in zip(jobs, done) if o[0] is not None]
    if kept:
        report = build_report([j for j, _ in kept], [o for _, o in kept], settings, command)
        write_report(report, out_dir)
    print(
        f"\ninterrupted: {len(kept)} of {len(jobs)} configuration(s) have results in "
        f"{out_dir / 'report.md'}; continue with: "
        f"{command_line(argparse.Namespace(**{**vars(ns), 'resume': True, 'out': str(out_dir)}))}",
        file=sys.stderr,
    )

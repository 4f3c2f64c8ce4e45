"""Qwen2.5-7B start-up to first token from a checkpoint on local disk (issue 19, acceptance 4):
a bf16 safetensors checkpoint of the real shape (random weights) is written once, then a fresh
process loads it with `LLM` (CUDA graphs captured, the default) and generates one token — first
with empty Triton / pagoda caches (cold), then twice more with the caches the first run left
(warm). Each time is from the process's launch to its first token, imports included.

    python benchmarks/deploy/startup_7b.py --out benchmarks/results/startup_7b_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks/configs/qwen2.5-7b.json"
TOKENIZER = ROOT / "tests/fixtures/qwen2.5-tokenizer"
SHARD_BYTES = 4 << 30


def write_checkpoint(config: Path, out: Path) -> float:
    """A bf16 checkpoint of `config`'s shape with random weights (N(0, 0.02)), HF tensor names
    (from transformers' model on the meta device), sharded with an index; returns GiB written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, out / "config.json")
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    names = {n: p.shape for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            shards.append(shard)
            name = f"model-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in names.items():
        t = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        t.normal_(0.0, 0.02, generator=gen) if len(shape) > 1 else t.fill_(1.0)
        shard[name] = t.cpu()
        nbytes = t.numel() * 2
        size += nbytes
        total += nbytes
        if size >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total / 2**30


def child(model: str, launched: float, max_model_len: int) -> None:
    t_import = time.time()
    from pagoda import LLM, SamplingParams

    t_imported = time.time()
    llm = LLM(model, max_model_len=max_model_len)
    t_loaded = time.time()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    t_first = time.time()
    print(
        "@@"
        + json.dumps(
            {
                "interpreter_start_s": t_import - launched,
                "import_s": t_imported - t_import,
                "engine_init_s": t_loaded - t_imported,
                "first_token_s": t_first - t_loaded,
                "launch_to_first_token_s": t_first - launched,
                "tokens": out[0].outputs[0].token_ids,
            }
        ),
        flush=True,
    )
    llm.shutdown()


def run_once(model: str, env: dict[str, str], max_model_len: int) -> dict:
    launched = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", model, "--launched", repr(launched),
         "--max-model-len", str(max_model_len)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[0][2:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--checkpoint", default=None, help="reuse/write the checkpoint here")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--warm-runs", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.launched, args.max_model_len)
        return 0
    if not args.out:
        p.error("--out is required")
    ckpt = Path(args.checkpoint or tempfile.mkdtemp(prefix="qwen7b-"))
    t0 = time.time()
    gib = None
    if not (ckpt / "model.safetensors.index.json").exists():
        gib = write_checkpoint(CONFIG, ckpt)
    write_s = time.time() - t0
    caches = Path(tempfile.mkdtemp(prefix="startup-caches-"))
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(caches / "triton")
    env["XDG_CACHE_HOME"] = str(caches / "xdg")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cold = run_once(str(ckpt), env, args.max_model_len)
    print(f"cold: {cold['launch_to_first_token_s']:.1f} s", flush=True)
    warm = []
    for i in range(args.warm_runs):
        warm.append(run_once(str(ckpt), env, args.max_model_len))
        print(f"warm {i + 1}: {warm[-1]['launch_to_first_token_s']:.1f} s", flush=True)
    best = min(w["launch_to_first_token_s"] for w in warm)
    result = {
        "model": "Qwen2.5-7B shape, bf16, random weights, safetensors on local disk",
        "checkpoint_gib": gib,
        "checkpoint_write_s": write_s,
        "max_model_len": args.max_model_len,
        "cold": cold,
        "warm": warm,
        "warm_best_s": best,
        "target_s": 15.0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"cold {cold['launch_to_first_token_s']:.1f} s, warm best {best:.1f} s (target <= 15 s)")
    return 0 if best <= 15.0 else 1


if __name__ == "__main__":
    sys.exit(main())

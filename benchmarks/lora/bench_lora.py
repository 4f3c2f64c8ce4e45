"""Decode tok/s of unmerged LoRA serving (1 and 4 adapters) against the merged model.

A merged adapter costs exactly what the base model costs, so "merged" is the engine without
LoRA on the same dummy weights; the LoRA runs use random PEFT adapters (all seven projections,
rank `--rank`) written to a temporary directory. Decode rate = B * (N - 1) / (t(N) - t(1)):
two `generate` calls on fresh prompts (no prefix-cache hits), the second timing prefill only.

    python benchmarks/lora/bench_lora.py --out benchmarks/results/lora_qwen2.5-3b_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.common import environment, free_device_memory, write_result

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="config:benchmarks/configs/qwen2.5-3b.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p.parse_args(argv)


def _projection_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """HF projection name -> (in, out) of one decoder layer."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def write_random_adapter(path: Path, text_config: Any, rank: int, seed: int) -> None:
    """A PEFT-format LoRA adapter for every projection, with small random weights."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text_config.num_hidden_layers):
        for name, (n_in, n_out) in _projection_shapes(text_config).items():
            module = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{name}"
            a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, rank, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(_TARGETS),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def _decode_rate(
    llm: Any, batch: int, ns: argparse.Namespace, loras: list[Any], seed: int
) -> tuple[float, float]:
    """(decode tok/s, seconds per decode step), median over iterations."""
    from pagoda import SamplingParams

    vocab = min(llm.llm_engine.model_config.text_config.vocab_size, 10000)
    rng = random.Random(seed)
    full = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lora_list = [loras[i % len(loras)] for i in range(batch)] if loras else None

    def timed(params: SamplingParams) -> float:
        prompts = [[rng.randrange(vocab) for _ in range(ns.prompt_len)] for _ in range(batch)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora_list)
        return time.perf_counter() - t0

    timed(full)  # warm-up (Triton autotuning / compilation, adapters into their slots)
    rates, steps = [], []
    for _ in range(ns.iters):
        t_prefill = timed(first)
        t_full = timed(full)
        decode = max(t_full - t_prefill, 1e-9)
        rates.append(batch * (ns.output_len - 1) / decode)
        steps.append(decode / (ns.output_len - 1))
    return statistics.median(rates), statistics.median(steps)


def _engine(ns: argparse.Namespace, lora: bool, max_batch: int) -> Any:
    from pagoda import LLM

    kwargs: dict[str, Any] = {}
    if lora:
        kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=ns.rank)
    return LLM(
        ns.model,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enforce_eager=ns.enforce_eager,
        max_num_seqs=max(max_batch, 8),
        skip_tokenizer_init=True,
        print_memory_report=False,
        **kwargs,
    )


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from pagoda import LoRARequest
    from pagoda.engine.args import EngineArgs

    batches = [int(b) for b in ns.batch_sizes.split(",")]
    _, model_config, *_ = EngineArgs(model=ns.model, device=ns.device).create_configs()
    device = torch.device(
        "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    result: dict[str, Any] = {
        "benchmark": "lora_decode",
        "model": ns.model,
        "dtype": ns.dtype,
        "rank": ns.rank,
        "prompt_len": ns.prompt_len,
        "output_len": ns.output_len,
        "env": environment(device),
        "runs": [],
    }
    runs: list[dict[str, Any]] = result["runs"]

    print("merged (no LoRA) ...", file=sys.stderr)
    llm = _engine(ns, lora=False, max_batch=max(batches))
    for b in batches:
        rate, step = _decode_rate(llm, b, ns, [], seed=b)
        runs.append(dict(mode="merged", adapters=0, batch=b, decode_tok_s=rate, step_s=step))
        print(f"  merged      B={b:<4} {rate:10.1f} tok/s", file=sys.stderr)
    del llm
    free_device_memory()

    with tempfile.TemporaryDirectory(prefix="pagoda-lora-bench-") as tmp:
        loras = []
        for i in range(4):
            path = Path(tmp) / f"adapter{i}"
            write_random_adapter(path, model_config.text_config, ns.rank, seed=i)
            loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
        llm = _engine(ns, lora=True, max_batch=max(batches))
        for b in batches:
            for mode, chosen in (("lora-base", []), ("lora-1", loras[:1]), ("lora-4", loras)):
                if mode == "lora-4" and b < 4:
                    continue  # four adapters need four requests
                rate, step = _decode_rate(llm, b, ns, chosen, seed=b)
                runs.append(
                    dict(mode=mode, adapters=len(chosen), batch=b, decode_tok_s=rate, step_s=step)
                )
                print(f"  {mode:<11} B={b:<4} {rate:10.1f} tok/s", file=sys.stderr)
        del llm
        free_device_memory()

    merged = {r["batch"]: r["decode_tok_s"] for r in runs if r["mode"] == "merged"}
    for r in runs:
        r["vs_merged"] = r["decode_tok_s"] / merged[r["batch"]]
    print(f"\n{'mode':<12}{'batch':>6}{'decode tok/s':>14}{'vs merged':>11}")
    for r in runs:
        print(f"{r['mode']:<12}{r['batch']:>6}{r['decode_tok_s']:>14.1f}{r['vs_merged']:>10.2f}x")
    write_result(ns.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quantize a model with llmcompressor's GPTQ on pagoda's calibration samples (the baseline).

Run in an environment with `llmcompressor==0.14.*` (e.g. a venv with --system-site-packages
so pagoda is importable). A GGUF model (the embedded SmolLM2) is first dequantized to a
float32 Hugging Face directory. The samples are exactly those `pagoda quantize` draws
(`pagoda.quantizer.calibration.load_calibration_data`, same seed), fed in the same order.
Usage: python benchmarks/quant/llmcompressor_baseline.py OUT_DIR --dataset calib.txt [...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def hf_dir_from_gguf(gguf_path: str, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint to a float32 safetensors directory (with its tokenizer)."""
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import load_tokenizer, resolve_model

    if (out_dir / "config.json").is_file():
        return out_dir
    p = Path(gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain model.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out_dir)
    load_tokenizer(resolve_model(gguf_path)).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--actorder", default="static")
    parser.add_argument("--dampening", type=float, default=0.01)
    parser.add_argument("--block-size", type=int, default=128)
    ns = parser.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.model_files import default_model_path, load_tokenizer, resolve_model
    from pagoda.quantizer.calibration import load_calibration_data

    model_arg = ns.model or default_model_path()
    source = resolve_model(model_arg)
    out = Path(ns.out_dir)
    hf_dir = Path(str(out) + ".source")
    if source.kind == "gguf":
        hf_dir = hf_dir_from_gguf(source.path, hf_dir)
    else:
        hf_dir = Path(source.path)
    data = load_calibration_data(
        ns.dataset, load_tokenizer(source), ns.num_samples, ns.max_seq_len, ns.seed
    )
    ids = [s.tolist() for s in data.samples]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]})
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    recipe = GPTQModifier(
        config_groups={
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": ns.group_size,
                },
            }
        },
        ignore=["lm_head"],
        block_size=ns.block_size,
        dampening_frac=ns.dampening,
        actorder=None if ns.actorder == "none" else ns.actorder,
    )
    start = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=ns.max_seq_len,
        shuffle_calibration_samples=False,
        output_dir=str(out),
    )
    seconds = time.perf_counter() - start
    info = {
        "seconds": seconds,
        "num_samples": len(ids),
        "num_tokens": data.num_tokens,
        "torch_threads": torch.get_num_threads(),
    }
    (out / "llmcompressor_run.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


if __name__ == "__main__":
    main()

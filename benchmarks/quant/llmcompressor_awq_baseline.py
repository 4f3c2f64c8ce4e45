"""Quantize a model with llmcompressor's AWQModifier on pagoda's calibration samples (baseline).

Run with `llmcompressor==0.14.*` (a venv with --system-site-packages, so pagoda is importable).
Recipe: AWQModifier (duo scaling, 20 grid points, its default Llama mappings) then
QuantizationModifier W4A16_ASYM with the given group size, `lm_head` ignored. The samples are
exactly those `pagoda quantize` draws (`load_calibration_data`, same seed), in the same order.

CPU workaround: AWQModifier pins its cached layer inputs (`IntermediatesCache.pin_memory`) before
each grid search, which needs a CUDA driver; pinning only speeds host-to-device copies, which a
CPU run never makes, so the script replaces it with a no-op for this process.
Usage: python benchmarks/quant/llmcompressor_awq_baseline.py OUT_DIR --dataset calib.txt [...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmcompressor_baseline import hf_dir_from_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=64)
    ns = parser.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.model_files import default_model_path, load_tokenizer, resolve_model
    from pagoda.quantizer.calibration import load_calibration_data

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # CPU: see docstring

    source = resolve_model(ns.model or default_model_path())
    out = Path(ns.out_dir)
    hf_dir = Path(source.path)
    if source.kind == "gguf":
        hf_dir = hf_dir_from_gguf(source.path, Path(str(out) + ".source"))
    data = load_calibration_data(
        ns.dataset, load_tokenizer(source), ns.num_samples, ns.max_seq_len, ns.seed
    )
    ids = [s.tolist() for s in data.samples]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]})
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    recipe = [
        AWQModifier(duo_scaling=True, n_grid=20),
        QuantizationModifier(
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": False,
                        "strategy": "group",
                        "group_size": ns.group_size,
                    },
                }
            },
            ignore=["lm_head"],
        ),
    ]
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

"""Qwen2.5-VL latency: one 1280x720 image + a short question, TTFT and decode tok/s.

pagoda (bf16, and W4A16 when the checkpoint or `config:...:w4a16` loads) beside transformers'
`generate` on the same shapes in the same run. Dummy weights by default
(`config:benchmarks/configs/qwen2.5-vl-3b.json`, the tokenizer from tests/fixtures); every
iteration sends a new random image so neither the prefix cache nor the encoder cache can help.
TTFT includes image decoding and preprocessing on both sides. Usage:
    python benchmarks/vl/bench_vl.py --out benchmarks/results/vl_qwen2.5-vl-3b_h200.json
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagoda.bench.common import environment, free_device_memory, write_result

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = f"config:{ROOT / 'benchmarks/configs/qwen2.5-vl-3b.json'}"
DEFAULT_TOKENIZER = str(ROOT / "tests/fixtures/qwen2.5-tokenizer")
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)


def _image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    # A smooth gradient plus noise, JPEG-encoded: a realistic decode cost, unlike raw noise.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_pagoda(args: argparse.Namespace, model: str, label: str) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        limit_mm_per_prompt={"image": 1},
        enforce_eager=args.enforce_eager,
        print_memory_report=False,
    )
    startup = time.perf_counter() - t0
    question = PROMPT.format(question=args.question)

    def run(seed: int, max_tokens: int) -> tuple[float, float, int, int]:
        prompt = {"prompt": question, "multi_modal_data": {"image": _image(*args.size, seed)}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.time()
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        m = out.metrics
        ttft = m.first_token_time - start
        decode = m.last_token_time - m.first_token_time
        return ttft, decode, len(out.outputs[0].token_ids), len(out.prompt_token_ids)

    for i in range(args.warmup):
        run(10_000 + i, args.output_len)
    ttfts, rates = [], []
    prompt_len = 0
    for i in range(args.iters):
        ttft, decode, n, prompt_len = run(i, args.output_len)
        ttfts.append(ttft)
        rates.append((n - 1) / decode)
    encoder_runner = llm.llm_engine.core.runner.encoder_runner
    report = llm.memory_report()
    result = {
        "engine": "pagoda",
        "label": label,
        "model": model,
        "prompt_tokens": prompt_len,
        "image_tokens": prompt_len - len(llm.get_tokenizer()(question).input_ids) + 1,
        "output_tokens": args.output_len,
        "ttft_s": _summary(ttfts),
        "decode_tok_s": _summary(rates),
        "startup_s": startup,
        "weights_gib": report.weights_bytes / 2**30,
        "kv_cache_gib": report.kv_cache_bytes / 2**30,
        "images_encoded": encoder_runner.num_encoded,
    }
    llm = None  # the closure above holds the name: release the engine before the next one
    free_device_memory()
    return result


def bench_transformers(args: argparse.Namespace, hf_config: Any) -> dict[str, Any]:
    from transformers import (
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
        Qwen2_5_VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagoda.config import MultiModalConfig
    from pagoda.multimodal.image_loader import ImageLoader

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            hf_config, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    processor = Qwen2VLImageProcessorPil()
    loader = ImageLoader(MultiModalConfig())
    text = PROMPT.format(question=args.question)
    image_token = "<|image_pad|>"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class Stamps(LogitsProcessor):
        """Called once per generated token, right after its logits: token timestamps."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            sync()
            self.times.append(time.perf_counter())
            return scores

    def run(seed: int, max_new: int) -> tuple[float, float, int]:
        """(TTFT, decode seconds after the first token, tokens) of one generate call."""
        stamps = Stamps()
        sync()
        start = time.perf_counter()
        image = loader.load(_image(*args.size, seed))
        pixels = processor(images=[image])
        n = int(np.prod(pixels["image_grid_thw"][0])) // 4
        ids = tokenizer(text.replace(image_token, image_token * n), return_tensors="pt")
        input_ids = ids.input_ids.to(device)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.from_numpy(pixels["pixel_values"]).to(device, dtype),
                image_grid_thw=torch.from_numpy(pixels["image_grid_thw"]).to(device),
                mm_token_type_ids=(input_ids == hf_config.image_token_id).int(),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamps]),
            )
        t = stamps.times
        return t[0] - start, t[-1] - t[0], out.shape[1] - input_ids.shape[1]

    for i in range(args.warmup):
        run(10_000 + i, 4)
    ttfts, rates = [], []
    for i in range(args.iters):
        ttft, decode, n = run(i, args.output_len)
        ttfts.append(ttft)
        rates.append((n - 1) / decode)
    model = None
    free_device_memory()
    return {
        "engine": "transformers",
        "label": f"{args.dtype} sdpa generate",
        "ttft_s": _summary(ttfts),
        "decode_tok_s": _summary(rates),
        "output_tokens": args.output_len,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--w4a16-model", default=None,
                   help="a W4A16 checkpoint; default: the --model config with :w4a16")  # fmt: skip
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--size", default="1280x720", help="image WIDTHxHEIGHT")
    p.add_argument("--question", default="이 사진 속 장소는 어디인가요? Describe it briefly.")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    args.size = tuple(int(v) for v in args.size.lower().split("x"))

    from pagoda.model_files import load_hf_config, resolve_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = [bench_pagoda(args, args.model, args.dtype)]
    quant_model = args.w4a16_model or (
        f"{args.model}:w4a16" if args.model.startswith("config:") else None
    )
    if quant_model is not None:
        try:
            results.append(bench_pagoda(args, quant_model, "w4a16"))
        except (NotImplementedError, ValueError) as e:  # until the quantizer lands
            results.append({"engine": "pagoda", "label": "w4a16", "unavailable": str(e)})
            free_device_memory()
    if not args.skip_transformers:
        hf_config = load_hf_config(resolve_model(args.model))
        results.append(bench_transformers(args, hf_config))
    base = next((r for r in results if r["engine"] == "transformers"), None)
    for r in results:
        if base is not None and r["engine"] == "pagoda" and "ttft_s" in r:
            r["ttft_vs_transformers"] = base["ttft_s"]["median"] / r["ttft_s"]["median"]
            r["decode_vs_transformers"] = (
                r["decode_tok_s"]["median"] / base["decode_tok_s"]["median"]
            )
        if "ttft_s" in r:
            print(
                f"{r['engine']:>12} {r['label']:<22} TTFT {r['ttft_s']['median'] * 1e3:8.1f} ms"
                f"   decode {r['decode_tok_s']['median']:8.1f} tok/s"
            )
        else:
            print(f"{r['engine']:>12} {r['label']:<22} unavailable: {r['unavailable']}")
    result = {
        "benchmark": "vl_latency",
        "command": "python benchmarks/vl/bench_vl.py " + " ".join(argv or []),
        "environment": environment(device),
        "image_size": list(args.size),
        "results": results,
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

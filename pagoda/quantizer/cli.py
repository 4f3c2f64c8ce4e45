"""`pagoda quantize MODEL --out DIR [--evaluate TEXT]`, `pagoda eval perplexity MODEL --text F`.

Discovered by `pagoda.cli` through `register(subparsers)`. Mistakes (bad scheme,
group size, calibration file, architecture) surface as ValueError and end as `error: ...`.
"""

from __future__ import annotations

import argparse
import json

from pagoda.entrypoints.cli_args import add_model_arg


def _group_size(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"group size must be an integer, got {text!r}") from None


def _ignore_list(ns: argparse.Namespace) -> list[str]:
    """--ignore patterns, with lm_head added unless --quantize-lm-head asks for it."""
    from pagoda.quantizer.pipeline import matches_ignore

    ignore = list(ns.ignore or [])
    if ns.quantize_lm_head:
        covering = [p for p in ignore if matches_ignore("lm_head", [p])]
        if covering:
            raise ValueError(
                f"--quantize-lm-head contradicts --ignore {' '.join(covering)}, which keeps "
                "lm_head unquantized"
            )
        return ignore
    return ignore if "lm_head" in ignore else ["lm_head", *ignore]


def _check_evaluation_args(ns: argparse.Namespace) -> None:
    """--evaluate's mistakes, before minutes of quantizing rather than after."""
    from pathlib import Path

    if not Path(ns.evaluate).is_file():
        raise ValueError(f"--evaluate {ns.evaluate}: text file not found")
    if ns.eval_tokens < 2:
        raise ValueError(f"--eval-tokens must be >= 2, got {ns.eval_tokens}")
    if ns.eval_window < 2:
        raise ValueError(f"--eval-window must be >= 2, got {ns.eval_window}")


def _cmd_quantize(ns: argparse.Namespace) -> int:
    from pagoda.quantizer.api import quantize

    fp8 = (ns.scheme or "").upper() in ("FP8", "FP8_DYNAMIC")
    method = ns.method or ("rtn" if fp8 else "gptq")
    if ns.evaluate is not None:
        _check_evaluation_args(ns)
    if method != "rtn" and ns.dataset is None:
        # the API's message names its argument; the CLI user needs the flag
        what = "GPTQ" if method == "gptq" else "AWQ"
        raise ValueError(
            f"{what} needs calibration data: pass --dataset FILE (.json/.jsonl chats or text, "
            "or plain text; see `pagoda quantize --help`), or use --method rtn"
        )

    report = quantize(
        ns.model,
        ns.out,
        scheme=ns.scheme,
        method=method,
        kv_cache_dtype=ns.kv_cache_dtype,
        group_size=ns.group_size,
        ignore=_ignore_list(ns),
        dataset=ns.dataset,
        num_samples=ns.num_samples,
        max_seq_len=ns.max_seq_len,
        seed=ns.seed,
        dampening=ns.dampening,
        block_size=ns.block_size,
        actorder=None if ns.actorder == "none" else ns.actorder,
        device=ns.device,
        dtype=ns.dtype,
        progress=not ns.no_progress,
        gptq_scales=ns.gptq_scales,
        format=ns.format,
        text_only_calibration=ns.text_only_calibration,
        awq_clip=ns.awq_clip,
        loss_weighted_hessians=ns.loss_weighted_hessians,
        refine_steps=ns.refine_steps,
    )
    print(report.summary())
    print(f"wrote {ns.out}")
    record = report.to_dict()
    if ns.evaluate:
        record["evaluation"] = _evaluate(ns)
    if ns.report:
        with open(ns.report, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0


def _evaluate(ns: argparse.Namespace) -> dict[str, dict]:
    """Perplexity of the unquantized model and of the checkpoint just written, on the same
    tokens of `--evaluate`'s text (same windows, dtype and device); printed side by side."""
    from dataclasses import asdict

    from pagoda.bench.perplexity import evaluate

    results = {}
    for name, model in (("unquantized", ns.model), ("quantized", ns.out)):
        results[name] = evaluate(
            model, ns.evaluate, ns.eval_tokens, ns.eval_window, ns.eval_window,
            device=ns.device, dtype=ns.eval_dtype,
        )  # fmt: skip
    base, quant = results["unquantized"], results["quantized"]
    print(
        f"held-out perplexity on {ns.evaluate} ({quant.num_scored} tokens, window "
        f"{quant.window}, {ns.eval_dtype}):\n"
        f"  unquantized {base.perplexity:10.4f}\n"
        f"  quantized   {quant.perplexity:10.4f}  "
        f"({100 * (quant.perplexity / base.perplexity - 1):+.2f} %)"
    )
    return {k: asdict(v) for k, v in results.items()}


def _cmd_perplexity(ns: argparse.Namespace) -> int:
    from pagoda.bench import perplexity

    return perplexity.main(ns)


def register(sub: argparse._SubParsersAction) -> None:
    from pagoda.quantizer.calibration import formats_help

    q = sub.add_parser(
        "quantize",
        help="quantize a model (GPTQ / AWQ / RTN)",
        epilog=formats_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(q, help="HF model directory or .gguf file (default: the embedded SmolLM2)")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.add_argument(
        "--scheme",
        default=None,
        help="W4A16 | W4A16_ASYM | W8A16 | FP8_DYNAMIC (FP8 weights, per-token dynamic "
        "activations, no calibration) | FP8 (static activation scales: needs --dataset) "
        "(default: W4A16, or W4A16_ASYM for AWQ)",
    )
    q.add_argument(
        "--method",
        default=None,
        choices=["gptq", "rtn", "awq"],
        help="default gptq (rtn for the FP8 schemes, which are min-max rounded); awq: AWQ's "
        "activation-aware scales, then round to nearest",
    )
    q.add_argument(
        "--awq-clip",
        action="store_true",
        help="AWQ: also search per-group weight clipping (AutoAWQ's clip). Off by default: "
        "on Qwen2.5-Coder-0.5B it lowered calibration error but raised held-out perplexity",
    )
    q.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["fp8", "fp8_e4m3"],
        help="calibrate per-layer K / V scales on --dataset for an FP8 KV cache "
        "(compressed-tensors kv_cache_scheme; serve with --kv-cache-dtype fp8)",
    )
    q.add_argument(
        "--format",
        default="compressed-tensors",
        choices=["compressed-tensors", "autoawq"],
        help="checkpoint layout: compressed-tensors (pack-quantized), or AutoAWQ's GEMM "
        "layout (quant_method awq; 4-bit, lm_head dense)",
    )
    q.add_argument(
        "--group-size",
        type=_group_size,
        default=None,
        help="weights per scale; -1: per channel (default: 128, or the largest of 64 / 32 "
        "that divides every quantized layer's input, with a note)",
    )
    q.add_argument(
        "--ignore",
        action="append",
        default=None,
        help="module kept unquantized: exact name or 're:' pattern matched at the "
        "start of the dotted name (repeatable). lm_head is always added unless "
        "--quantize-lm-head is given. Vision-language models: "
        "pass 're:.*visual.*' as for llmcompressor; the vision tower is kept unquantized "
        "either way (with a note when no rule covers it)",
    )
    q.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize lm_head too, with the same scheme (GPTQ: calibrated on the final-norm "
        "outputs of the quantized decoder); it is then left out of quantization_config.ignore. "
        "Models with tied embeddings keep it dense (with a warning). Qwen2.5-7B: the 1.09 GB "
        "bf16 head becomes about 0.28 GB at W4A16 g128",
    )
    q.add_argument(
        "--dataset",
        default=None,
        help="calibration file: messages / conversations / text records (.json or .jsonl), "
        "or plain text; formats below",
    )
    q.add_argument(
        "--text-only-calibration",
        action="store_true",
        help="vision-language models: drop the chats' images and videos and calibrate the "
        "decoder on their text (default: the images go through the unquantized vision tower, "
        "so the statistics include the image tokens)",
    )
    q.add_argument("--num-samples", type=int, default=256)
    q.add_argument("--max-seq-len", type=int, default=2048)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dampening", type=float, default=0.01)
    q.add_argument("--block-size", type=int, default=128)
    q.add_argument("--actorder", default="static", choices=["static", "none"])
    q.add_argument("--device", default="auto", help="auto | cpu | cuda")
    q.add_argument(
        "--dtype",
        default="auto",
        help="stored dtype of scales and unquantized tensors (auto: the model's)",
    )
    q.add_argument(
        "--gptq-scales",
        default="first_touch",
        choices=["first_touch", "upfront"],
        help="group scales from the error-updated weights when GPTQ reaches the group "
        "(default) or from the original weights up front (llmcompressor's way)",
    )
    q.add_argument(
        "--loss-weighted-hessians",
        action="store_true",
        help="GPTQ: weight each calibration token in a linear's Hessian by the float model's "
        "next-token loss gradient at that linear's output (one backward pass a sample, the "
        "whole model in memory; Qwen2.5-Coder-0.5B g128: 35 %% of the RTN gap closed against "
        "29 %%, 1.7x the time)",
    )
    q.add_argument(
        "--refine-steps",
        type=int,
        default=0,
        metavar="N",
        help="GPTQ / RTN: N signed-gradient steps per layer moving codes to lower the layer's "
        "output error against the float layer (16 samples a step; default 0: off)",
    )
    q.add_argument(
        "--evaluate",
        default=None,
        metavar="TEXT_FILE",
        help="afterwards, print the perplexity of the quantized and of the unquantized model "
        "on this held-out UTF-8 text (not the calibration text), side by side",
    )
    q.add_argument("--eval-tokens", type=int, default=20000, help="--evaluate: first N tokens")
    q.add_argument("--eval-window", type=int, default=1024, help="--evaluate: tokens per window")
    q.add_argument(
        "--eval-dtype", default="float32", help="--evaluate: activation dtype of both models"
    )
    q.add_argument("--report", default=None, help="also write the report JSON here")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=_cmd_quantize)

    from pagoda.bench import perplexity

    ev = sub.add_parser("eval", help="evaluate a model (perplexity)")
    ev_sub = ev.add_subparsers(dest="eval", required=True)
    ppl = ev_sub.add_parser("perplexity", help="perplexity on a text file")
    perplexity.add_arguments(ppl)
    ppl.set_defaults(func=_cmd_perplexity)

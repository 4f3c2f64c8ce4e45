"""`pagoda quantize MODEL --out DIR ...` and `pagoda eval perplexity MODEL --text FILE`.

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


def _cmd_quantize(ns: argparse.Namespace) -> int:
    from pagoda.quantizer.api import quantize

    if ns.method != "rtn" and ns.dataset is None:
        # the API's message names its argument; the CLI user needs the flag
        what = "GPTQ" if ns.method == "gptq" else "AWQ"
        raise ValueError(
            f"{what} needs calibration data: pass --dataset FILE (.json/.jsonl chats or text, "
            "or plain text; see `pagoda quantize --help`), or use --method rtn"
        )

    report = quantize(
        ns.model,
        ns.out,
        scheme=ns.scheme,
        method=ns.method,
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
    )
    print(report.summary())
    print(f"wrote {ns.out}")
    if ns.report:
        with open(ns.report, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0


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
        help="W4A16 | W4A16_ASYM | W8A16 (default: W4A16, or W4A16_ASYM for AWQ)",
    )
    q.add_argument(
        "--method",
        default="gptq",
        choices=["gptq", "rtn", "awq"],
        help="awq: AWQ's activation-aware scales and clipping, then round to nearest",
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
    q.add_argument("--report", default=None, help="also write the report JSON here")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=_cmd_quantize)

    from pagoda.bench import perplexity

    ev = sub.add_parser("eval", help="evaluate a model (perplexity)")
    ev_sub = ev.add_subparsers(dest="eval", required=True)
    ppl = ev_sub.add_parser("perplexity", help="perplexity on a text file")
    perplexity.add_arguments(ppl)
    ppl.set_defaults(func=_cmd_perplexity)

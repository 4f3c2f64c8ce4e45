"""`pagoda lora ...`: LoRA adapter tools on the command line.

`pagoda lora merge --base MODEL --adapter DIR --out DIR [--dtype bf16]` folds a PEFT adapter
into its base model and writes a normal model directory (ready for `pagoda quantize` or
`pagoda serve`). The main CLI discovers `register` and turns ValueError into `error: ...`.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    lora = subparsers.add_parser("lora", help="LoRA adapter tools (merge)")
    sub = lora.add_subparsers(dest="lora_command", required=True)
    merge = sub.add_parser(
        "merge",
        help="merge a PEFT LoRA adapter into its base model",
        description="Fold a PEFT LoRA adapter (and non_lora_state_dict.bin, when present) into "
        "the base model's weights and write a normal Hugging Face model directory.",
    )
    merge.add_argument("--base", required=True, help="base model directory (safetensors)")
    merge.add_argument("--adapter", required=True, help="PEFT adapter directory")
    merge.add_argument("--out", required=True, help="output directory (must not exist)")
    merge.add_argument(
        "--dtype", default=None, help="cast floating weights: bf16 | fp16 | fp32 (default: keep)"
    )
    merge.add_argument("--no-progress", action="store_true", help="no progress bar")
    merge.set_defaults(func=_cmd_merge)


def _cmd_merge(ns: argparse.Namespace) -> int:
    from pagoda.lora.merge import merge_lora

    report = merge_lora(ns.base, ns.adapter, ns.out, dtype=ns.dtype, progress=not ns.no_progress)
    lines = [
        f"merged {report.num_lora_modules} LoRA modules",
        f"replaced {report.num_replaced_tensors} trained tensors"
        if report.num_replaced_tensors
        else "",
        "untied lm_head from the embeddings" if report.untied_lm_head else "",
        f"tokenizer files from the adapter: {', '.join(report.files_from_adapter)}"
        if report.files_from_adapter
        else "",
    ]
    print("; ".join(line for line in lines if line))
    print(f"wrote {report.out_dir} ({report.num_shards} shard(s))")
    return 0

"""The engine's options as command-line flags: `add_engine_args` adds every `LLM(...)` option
to a parser, `engine_kwargs` turns the parsed flags back into `LLM(...)` keyword arguments.

Shared by every command that builds an engine (`pagoda generate/chat/serve/bench/compare`).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any


def add_async_scheduling_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--[no-]async-scheduling` (EngineArgs.async_scheduling; None = on with CUDA)."""
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs this one (default: on with CUDA)",
    )


_MODEL_HELP = (
    "model directory, .gguf file or config:PATH.json (default: the embedded SmolLM2-135M-Instruct)"
)


def add_model_arg(parser: argparse.ArgumentParser, help: str = _MODEL_HELP) -> None:
    """`pagoda COMMAND [MODEL]`: the model as the first positional, `--model/-m` as an alias.

    `merge_model_option` (run by `pagoda.cli.main` before every command) folds the two.
    """
    parser.add_argument("model", nargs="?", default=None, help=help)
    parser.add_argument(
        "--model",
        "-m",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the same as MODEL",
    )


def merge_model_option(ns: argparse.Namespace) -> None:
    """Set `ns.model` from `--model` when the positional MODEL was not given."""
    option = getattr(ns, "model_option", None)
    if option is None:
        return
    if ns.model is not None and ns.model != option:
        raise ValueError(
            f"two models given: {ns.model!r} (MODEL) and {option!r} (--model); pass one"
        )
    ns.model = option


def add_engine_args(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The options of `LLM(...)`, as flags, after `[MODEL]` (`add_model_arg`; `model=False`
    for a command that reads the model from its own positionals)."""
    if model:
        add_model_arg(parser)
    else:
        parser.set_defaults(model=None)
    g = parser.add_argument_group("engine (vLLM's flags and meanings)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument(
        "--max-model-len", type=human_readable_int, default=None, help="context length (e.g. 32k)"
    )
    g.add_argument(
        "--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.9
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=human_readable_int,
        default=None,
        help="KV cache size in bytes (e.g. 4G); overrides --gpu-memory-utilization",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache element type: auto (the model dtype) or FP8 (one byte: twice the "
        "tokens; e4m3 uses the checkpoint's k_scale / v_scale, 1.0 with a warning)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)",
    )
    g.add_argument("--disable-prefix-caching", "--no-prefix-caching", action="store_true")
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over several steps (default: on)",
    )
    g.add_argument("--disable-chunked-prefill", action="store_true")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    add_async_scheduling_arg(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="awq | gptq | compressed-tensors: must match the checkpoint (default: read from "
        "it); fp8 on a dense checkpoint: FP8_DYNAMIC weights quantized at load",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted: pagoda never runs code from a checkpoint (its own model code loads it)",
    )
    g.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0.0,
        help="GiB of weights kept in pinned host memory and streamed to the GPU per layer",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over N ranks (processes; one GPU each on CUDA, gloo on the CPU)",
    )
    mm = parser.add_argument_group("vision-language models")
    mm.add_argument(
        "--limit-mm-per-prompt",
        type=json_object,
        default=None,
        help='images and videos one prompt may carry, e.g. \'{"image": 4, "video": 1}\'',
    )
    mm.add_argument(
        "--mm-processor-kwargs",
        type=json_object,
        default=None,
        help="min_pixels, max_pixels (images and video frames), fps, min_frames, max_frames, "
        'total_pixels (videos), e.g. \'{"max_pixels": 1003520, "fps": 1}\'',
    )
    mm.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image and video URLs (off: data: URLs only)",
    )
    add_speculative_config_arg(g)


def human_readable_int(text: str) -> int:
    """`4096`, `32k` (10**3), `4G` (2**30): vLLM's human-readable integers."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 4G: {text!r}")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        return int(number)
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"no decimals with binary suffixes: {text!r} (use {suffix.lower()} for powers of 10)"
        )
    return int(number) << (10 * ("KMGT".index(suffix) + 1))


def json_object(text: str) -> dict[str, Any]:
    """A flag whose value is a JSON object (vLLM's dict-valued flags)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_speculative_config_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--speculative-config '<json>'` (EngineArgs.speculative_config, vLLM's flag)."""
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or a draft model sharing the '
        'target\'s tokenizer: \'{"model": DRAFT, "num_speculative_tokens": 4}\' or an EAGLE '
        'head trained for the target: \'{"method": "eagle", "model": HEAD_DIR, '
        '"num_speculative_tokens": 4}\'',
    )


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=ns.model,
        tokenizer=ns.tokenizer,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory=ns.kv_cache_memory,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        kv_cache_dtype=ns.kv_cache_dtype,
        enable_prefix_caching=ns.enable_prefix_caching and not ns.disable_prefix_caching,
        enable_chunked_prefill=ns.enable_chunked_prefill and not ns.disable_chunked_prefill,
        enforce_eager=ns.enforce_eager,
        async_scheduling=ns.async_scheduling,
        seed=ns.seed,
        load_format=ns.load_format,
        quantization=ns.quantization,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        cpu_offload_gb=ns.cpu_offload_gb,
        speculative_config=ns.speculative_config,
        tensor_parallel_size=ns.tensor_parallel_size,
        limit_mm_per_prompt=ns.limit_mm_per_prompt,
        mm_processor_kwargs=ns.mm_processor_kwargs,
        allow_remote_images=ns.allow_remote_images,
    )

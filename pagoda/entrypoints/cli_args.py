"""The engine's options as command-line flags: `add_engine_args` adds every `LLM(...)` option
to a parser, `engine_kwargs` turns the parsed flags back into `LLM(...)` keyword arguments.

Shared by every command that builds an engine (`pagoda generate/chat/serve/bench/compare`).
"""

from __future__ import annotations

import argparse
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


def parse_limit_mm(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`: vLLM's JSON (`{"image": 2}`) or `image=2`."""
    import json

    try:
        value = json.loads(text) if text.lstrip().startswith("{") else None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if value is None:
        key, sep, number = text.partition("=")
        if not sep or not number.strip().isdigit():
            raise argparse.ArgumentTypeError(f'expected image=N or {{"image": N}}, got {text!r}')
        value = {key.strip(): int(number)}
    bad = [k for k, v in value.items() if k != "image" or not isinstance(v, int) or v < 0]
    if bad:
        raise argparse.ArgumentTypeError(
            f"only an image count >= 0 is supported (image=N), got {text!r}"
        )
    return value


def _positive_pixels(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The options of `LLM(...)`, as flags, after `[MODEL]` (`add_model_arg`; `model=False`
    for a command that reads the model from its own positionals)."""
    if model:
        add_model_arg(parser)
    else:
        parser.set_defaults(model=None)
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true")
    add_async_scheduling_arg(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    g.add_argument(
        "--quantization",
        default=None,
        help="awq | gptq | compressed-tensors: must match the checkpoint (default: read from it)",
    )
    g.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0.0,
        help="GiB of weights kept in pinned host memory and streamed to the GPU per layer",
    )
    mm = parser.add_argument_group("images (vision-language models)")
    mm.add_argument(
        "--limit-mm-per-prompt",
        type=parse_limit_mm,
        default=None,
        metavar="image=N",
        help='images a prompt may carry (also vLLM\'s JSON, {"image": N}; default 4); the '
        "vision encoder's memory profile is sized for this many of the largest images",
    )
    mm.add_argument(
        "--max-pixels",
        type=_positive_pixels,
        default=None,
        help="largest image area the processor keeps (mm_processor_kwargs max_pixels); "
        "larger images are scaled down, which saves encoder memory and prompt tokens",
    )
    mm.add_argument(
        "--min-pixels", type=_positive_pixels, default=None, help="mm_processor_kwargs min_pixels"
    )


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory=ns.kv_cache_memory,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        enable_prefix_caching=not ns.no_prefix_caching,
        enforce_eager=ns.enforce_eager,
        async_scheduling=ns.async_scheduling,
        seed=ns.seed,
        load_format=ns.load_format,
        quantization=ns.quantization,
        cpu_offload_gb=ns.cpu_offload_gb,
        **_mm_kwargs(ns),
    )


def _mm_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The image options that were given (left out otherwise: text models reject them)."""
    out: dict[str, Any] = {}
    if ns.limit_mm_per_prompt is not None:
        out["limit_mm_per_prompt"] = ns.limit_mm_per_prompt
    pixels = {k: getattr(ns, k) for k in ("min_pixels", "max_pixels") if getattr(ns, k)}
    if pixels:
        out["mm_processor_kwargs"] = pixels
    return out

"""The engine's options as command-line flags: `add_engine_args` adds every `LLM(...)` option
to a parser, `engine_kwargs` turns the parsed flags back into `LLM(...)` keyword arguments.

Shared by every command that builds an engine (`pagoda generate/chat/serve/bench/compare`).
"""

from __future__ import annotations

import argparse
import json
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
        type=_json_object,
        default=None,
        help='images and videos one prompt may carry, e.g. \'{"image": 4, "video": 1}\'',
    )
    mm.add_argument(
        "--mm-processor-kwargs",
        type=_json_object,
        default=None,
        help="min_pixels, max_pixels (images and video frames), fps, min_frames, max_frames, "
        'total_pixels (videos), e.g. \'{"max_pixels": 1003520, "fps": 1}\'',
    )
    mm.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image and video URLs (off: data: URLs only)",
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object such as {{"image": 2}}: {text!r}')
    return value


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
        tensor_parallel_size=ns.tensor_parallel_size,
        limit_mm_per_prompt=ns.limit_mm_per_prompt,
        mm_processor_kwargs=ns.mm_processor_kwargs,
        allow_remote_images=ns.allow_remote_images,
    )

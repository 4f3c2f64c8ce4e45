"""The `pagoda` command line: generate, chat (and, from other modules, serve, quantize, bench).

With no model argument every command uses the embedded default model (SmolLM2-135M-Instruct),
fully offline. User mistakes end with a one-line `error: ...` and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_async_scheduling_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--[no-]async-scheduling` (EngineArgs.async_scheduling; None = on with CUDA)."""
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs this one (default: on with CUDA)",
    )


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """The options of `LLM(...)`, as flags."""
    if model_positional:
        parser.add_argument(
            "model",
            nargs="?",
            default=None,
            help="model directory, .gguf file or config:PATH.json "
            "(default: the embedded SmolLM2-135M-Instruct)",
        )
    else:
        parser.add_argument(
            "--model",
            "-m",
            default=None,
            help="model directory, .gguf file or config:PATH.json "
            "(default: the embedded SmolLM2-135M-Instruct)",
        )
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
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(ns: argparse.Namespace) -> Any:
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
    )


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    params = _sampling_params(ns)
    llm = LLM(**engine_kwargs(ns))
    if len(ns.prompt) == 1 and ns.stream:
        for out in llm.stream(ns.prompt[0], params):
            print(out.outputs[0].text, end="", flush=True)
        print()
        return 0
    for out in llm.generate(ns.prompt, params, use_tqdm=False):
        if len(ns.prompt) > 1:
            print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    params = _sampling_params(ns)
    llm = LLM(**engine_kwargs(ns))
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    engine = llm.llm_engine

    def answer(question: str) -> None:
        history.append({"role": "user", "content": question})
        processed = engine.input_processor.process_chat(history)
        rid = engine.next_request_id()
        engine.add_request(rid, None, params, delta=True, processed=processed)
        parts = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].text
                parts.append(delta)
                print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(parts)})

    if ns.message:
        for m in ns.message:
            answer(m)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if interactive:
            print("assistant> ", end="", flush=True)
        answer(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="LLM inference engine and weight quantizer"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (stdin, or --message)")
    chat.add_argument("--message", action="append", help="ask this and exit (repeatable)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=_cmd_chat)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list:
    """Sub-commands that live with their subsystems (server, quantizer, benchmarks)."""
    import importlib

    found = []
    for module in (
        "pagoda.entrypoints.openai.cli",
        "pagoda.quant.cli",
        "pagoda.bench.cli",
        "pagoda.lora.cli",
        "pagoda.bench.compare_cli",
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        found.append(mod.register)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

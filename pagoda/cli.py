"""The `pagoda` command line: generate, chat (and, from other modules, serve, quantize, bench).

With no model argument every command uses the embedded default model (SmolLM2-135M-Instruct),
fully offline. User mistakes end with a one-line `error: ...` and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagoda.bench import cli as bench_cli
from pagoda.bench import compare_cli
from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs
from pagoda.entrypoints.openai import cli as serve_cli
from pagoda.lora import cli as lora_cli
from pagoda.quantizer import cli as quantize_cli


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

    for module in _EXTRA_COMMANDS:
        module.register(sub)
    return parser


# Sub-commands that live with their subsystems (server, quantizer, benchmarks, LoRA, compare);
# each module is light at import time (its heavy imports happen when the command runs).
_EXTRA_COMMANDS = (serve_cli, quantize_cli, bench_cli, lora_cli, compare_cli)


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

"""The `pagoda` command line: generate, chat (and, from other modules, serve, quantize, bench).

With no model argument every command uses the embedded default model (SmolLM2-135M-Instruct),
fully offline. User mistakes end with a one-line `error: ...` and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import os
import sys
from typing import Any

from pagoda.bench import cli as bench_cli
from pagoda.bench import compare_cli
from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs, merge_model_option
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


def _looks_like_model(word: str) -> bool:
    """A first positional that names a model: `default`, config:..., an existing path."""
    return word == "default" or word.startswith("config:") or os.path.exists(word)


def _split_generate_words(ns: argparse.Namespace) -> None:
    """`pagoda generate [MODEL] PROMPT...`: the first word is the model when it names one
    (an existing directory or .gguf file, config:PATH.json, `default`) and prompts follow."""
    words = list(ns.words)
    if ns.model is None and len(words) > 1 and _looks_like_model(words[0]):
        ns.model = words.pop(0)
    elif ns.model is None and len(words) == 1 and os.path.isdir(words[0]):
        raise ValueError(f'{words[0]!r} is a directory: pagoda generate MODEL "PROMPT" ...')
    ns.model = None if ns.model == "default" else ns.model
    ns.prompt = words


def _image_messages(ns: argparse.Namespace, text: str) -> Any:
    """The user turn: the text alone, or `--image` parts first and then the text."""
    if not ns.image:
        return text
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": _image_url(src)}} for src in ns.image
    ]
    return [*parts, {"type": "text", "text": text}]


def _image_url(source: str) -> str:
    """data:, http(s):// and file:// URLs as given; a local file becomes a data: URL (checked
    here, before the model loads, so a typo costs nothing)."""
    if source.startswith(("data:", "http://", "https://", "file://")):
        return source
    if not os.path.isfile(source):
        raise ValueError(f"--image {source!r}: no such file (a path, or a data:/http(s) URL)")
    mime = mimetypes.guess_type(source)[0] or "application/octet-stream"
    with open(source, "rb") as f:
        return f"data:{mime};base64,{base64.b64encode(f.read()).decode()}"


def _check_images(ns: argparse.Namespace) -> None:
    """--image: every path exists and the model reads images, before anything loads."""
    if not ns.image:
        return
    for src in ns.image:
        _image_url(src)
    from pagoda.model_files import load_hf_config, resolve_model

    source = resolve_model(ns.model)
    if getattr(load_hf_config(source, lazy=True), "vision_config", None) is None:
        raise ValueError(
            f"--image needs a vision-language model; {source.name} reads text only "
            "(e.g. pagoda chat ./Qwen2.5-VL-3B-Instruct --image photo.jpg)"
        )


def _llm_for(ns: argparse.Namespace) -> Any:
    from pagoda.entrypoints.llm import LLM

    kwargs = engine_kwargs(ns)
    if any(src.startswith(("http://", "https://")) for src in ns.image or []):
        kwargs["allow_remote_images"] = True  # the user named the URL on the command line
    return LLM(**kwargs)


def _cmd_generate(ns: argparse.Namespace) -> int:
    _split_generate_words(ns)
    _check_images(ns)
    params = _sampling_params(ns)
    llm = _llm_for(ns)
    if ns.image:
        # an image prompt goes through the chat template, which places the image tokens
        for prompt in ns.prompt:
            message = [{"role": "user", "content": _image_messages(ns, prompt)}]
            out = llm.chat(message, params, use_tqdm=False)[0]
            if len(ns.prompt) > 1:
                print(f"--- {prompt!r}")
            print(out.outputs[0].text)
        return 0
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
    ns.model = None if ns.model == "default" else ns.model
    _check_images(ns)
    params = _sampling_params(ns)
    llm = _llm_for(ns)
    history: list[dict[str, Any]] = []
    pending_images = bool(ns.image)
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    engine = llm.llm_engine

    def answer(question: str) -> None:
        nonlocal pending_images
        # the images go with the first question; later turns see them in the history
        content = _image_messages(ns, question) if pending_images else question
        pending_images = False
        history.append({"role": "user", "content": content})
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


def _add_image_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH_OR_URL",
        help="an image for a vision-language model: a file, a data: URL or an http(s) URL "
        "(repeatable; chat: sent with the first question)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="LLM inference engine and weight quantizer"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="complete one or more prompts",
        usage="pagoda generate [MODEL] PROMPT [PROMPT ...] [options]",
    )
    gen.add_argument(
        "words",
        nargs="+",
        metavar="[MODEL] PROMPT",
        help="the model (a directory, .gguf file, config:PATH.json or 'default'; optional) "
        "and the prompt text (several prompts run as one batch)",
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument(
        "--model",
        "-m",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the model (alias of MODEL)",
    )
    _add_image_arg(gen)
    add_engine_args(gen, model=False)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (stdin, or --message)")
    chat.add_argument("--message", action="append", help="ask this and exit (repeatable)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_image_arg(chat)
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
        if not hasattr(ns, "words"):
            merge_model_option(ns)
        elif ns.model_option is not None:
            ns.model = ns.model_option
        return ns.func(ns)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`pagoda serve [MODEL]`: the OpenAI-compatible server as a sub-command of `pagoda`.

Takes every engine option of `LLM(...)` plus the server's own (host, port, API key, served
model name, concurrency and body-size limits). FastAPI and uvicorn are imported only when the
command runs, so the rest of the CLI works without the `server` extra.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagoda import envs
from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs

API_KEY_ENV = "PAGODA_API_KEY"
_SERVER_PACKAGES = frozenset({"fastapi", "starlette", "uvicorn", "prometheus_client"})


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
        description="Serve a model over the OpenAI API. Stop with Ctrl-C (SIGINT) or SIGTERM.",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 endpoints (default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model's)",
    )
    g.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        default=None,
        help="answer 429 to generation requests beyond this many in flight",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=None,
        help="largest accepted request body (default: 8 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds to let in-flight requests finish on SIGINT/SIGTERM",
    )
    g.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument("--no-access-log", action="store_true", help="do not log every request")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="serve these PEFT adapters unmerged; a request picks one by its 'model' field",
    )
    g.add_argument(
        "--max-loras",
        type=_positive_int,
        default=None,
        help="adapters resident on the device at once (default: all given, max 8)",
    )
    g.add_argument("--max-lora-rank", type=_positive_int, default=64)
    g.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool calls are read from the model's text with tool_choice auto "
        "(default: chosen from the chat template)",
    )
    g.add_argument(
        "--gil-switch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sys.setswitchinterval for the server process (default: Python's 0.005); with "
        "--engine-mode thread, lower lets the engine thread take the GIL back sooner",
    )
    g.add_argument(
        "--engine-mode",
        choices=["auto", "process", "thread"],
        default="auto",
        help="where the engine loop runs: its own process, so that it does not share the GIL "
        "with the HTTP side, or a thread of the server process (default auto: a process where "
        "one can be started)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        help="engine processes (replicas, each with its own device and KV cache) behind this "
        "server; requests go by load and by shared prompt prefix",
    )
    p.set_defaults(func=_cmd_serve)


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`name=path` pairs; a clear error for anything else."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        modules[name] = path
    return modules


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _cmd_serve(ns: argparse.Namespace) -> int:
    try:
        from pagoda.entrypoints.openai.api_server import ServerArgs, run_server
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _SERVER_PACKAGES:
            raise
        raise ValueError(
            f"pagoda serve needs the server extra ({e.name} is missing): "
            "pip install 'pagoda[server]'"
        ) from e
    from pagoda.engine.args import EngineArgs

    server_args = server_args_from(ns, ServerArgs)
    engine_args = EngineArgs(**engine_kwargs(ns), **server_args.engine_overrides())
    return run_server(engine_args, server_args)


def server_args_from(ns: argparse.Namespace, server_args_cls: type) -> Any:
    """The `ServerArgs` of the parsed flags (the API key falls back to $PAGODA_API_KEY)."""
    kwargs: dict[str, Any] = dict(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key if ns.api_key is not None else envs.api_key(),
        served_model_name=ns.served_model_name,
        max_concurrent_requests=ns.max_concurrent_requests,
        shutdown_timeout=ns.shutdown_timeout,
        log_level=ns.log_level,
        access_log=not ns.no_access_log,
        lora_modules=parse_lora_modules(ns.lora_modules),
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        tool_call_parser=ns.tool_call_parser,
        gil_switch_interval_s=ns.gil_switch_interval,
        engine_mode=ns.engine_mode,
        data_parallel_size=getattr(ns, "data_parallel_size", 1),
    )
    if ns.max_body_bytes is not None:
        kwargs["max_body_bytes"] = ns.max_body_bytes
    return server_args_cls(**kwargs)

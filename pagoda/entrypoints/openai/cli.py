"""`pagoda serve [MODEL]`: the OpenAI-compatible server as a sub-command of `pagoda`.

Takes every engine option of `LLM(...)` plus the server's own (host, port, API key, served
model name, concurrency and body-size limits). FastAPI and uvicorn are imported only when the
command runs, so the rest of the CLI works without the `server` extra.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagoda import envs
from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs, json_object
from pagoda.entrypoints.vllm_compat import add_vllm_flags, log_flag_notes

API_KEY_ENV = "PAGODA_API_KEY"
_SERVER_PACKAGES = frozenset({"fastapi", "starlette", "uvicorn", "prometheus_client"})


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
        description="Serve a model over the OpenAI API. Takes a `vllm serve` command line as it "
        "is: vLLM's flags have vLLM's meaning, and a flag pagoda cannot honour is an error that "
        "names it. Stop with Ctrl-C (SIGINT) or SIGTERM.",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (any of these) on /v1 endpoints "
        f"(default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names clients may use; responses carry the first (default: the model's)",
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
        help="seconds to let in-flight requests finish on SIGINT/SIGTERM (new ones get 503)",
    )
    g.add_argument(
        "--restart-engine",
        action="store_true",
        help="restart the engine process if it dies (default: the server exits non-zero, so "
        "that its supervisor restarts it)",
    )
    g.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: --log-level)",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        "--no-access-log",
        dest="no_access_log",
        action="store_true",
        help="do not log every request",
    )
    g.add_argument("--enable-uvicorn-access-log", dest="no_access_log", action="store_false")
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's prompt and sampling parameters",
    )
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false")
    g.add_argument("--max-log-len", type=int, default=None, help="prompt characters logged")
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted: pagoda logs no periodic statistics (read /metrics)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_list("--allowed-origins"),
        default=[],
        help="CORS origins, a JSON list (default: [], no cross-origin access; '[\"*\"]': any)",
    )
    g.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"])
    g.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"])
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-ca-certs", default=None)
    g.add_argument(
        "--ssl-cert-reqs", type=int, default=0, help="client certificates (ssl.CERT_*: 0, 1, 2)"
    )
    g.add_argument(
        "--root-path", default=None, help="path prefix of a reverse proxy (FastAPI's root_path)"
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no /docs, /redoc, /openapi.json",
    )
    g.add_argument("--enable-fastapi-docs", dest="disable_fastapi_docs", action="store_false")
    c = p.add_argument_group("chat, tools, reasoning, sampling defaults")
    c.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (Jinja) file, or the template itself (default: the model's)",
    )
    c.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tool_choice 'auto' (default: on, with the parser chosen from the chat template)",
    )
    c.add_argument(
        "--disable-auto-tool-choice", dest="enable_auto_tool_choice", action="store_false"
    )
    c.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool calls are read from the model's text with tool_choice auto "
        "(default: chosen from the chat template)",
    )
    c.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek_r1"],
        default=None,
        help="<think>...</think> becomes reasoning_content (Qwen3, DeepSeek-R1 style models)",
    )
    c.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most log-probs a request may ask for per token (at most 20)",
    )
    c.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none), "
        "or a folder holding a generation_config.json",
    )
    c.add_argument(
        "--override-generation-config",
        type=json_object,
        default=None,
        help="sampling defaults that override the generation config, as JSON",
    )
    lg = p.add_argument_group("LoRA")
    lg.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="serve these PEFT adapters unmerged (NAME=PATH or vLLM's JSON form); a request "
        "picks one by its 'model' field",
    )
    lg.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accepted: LoRA is on when --lora-modules names adapters",
    )
    lg.add_argument("--disable-lora", dest="enable_lora", action="store_false")
    lg.add_argument(
        "--max-loras",
        type=_positive_int,
        default=None,
        help="adapters resident on the device at once (default: all given, max 8)",
    )
    lg.add_argument("--max-lora-rank", type=_positive_int, default=64)
    lg.add_argument("--max-cpu-loras", type=_positive_int, default=None)
    x = p.add_argument_group("pagoda")
    x.add_argument(
        "--gil-switch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sys.setswitchinterval for the server process (default: Python's 0.005); with "
        "--engine-mode thread, lower lets the engine thread take the GIL back sooner",
    )
    x.add_argument(
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
    add_vllm_flags(p)
    p.set_defaults(func=_cmd_serve)


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`name=path` pairs; a clear error for anything else."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
                spec = f"{obj['name']}={obj['path']}"
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f'--lora-modules JSON entries are {{"name": ..., "path": ...}}, got {spec!r}'
                ) from None
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        modules[name] = path
    return modules


def _json_list(flag: str) -> Any:
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON list of strings, e.g. '[\"https://app.example\"]', "
                f"got {text!r}"
            )
        return value

    return parse


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
    log_flag_notes(ns)
    engine_args = EngineArgs(**engine_kwargs(ns), **server_args.engine_overrides())
    return run_server(engine_args, server_args)


def server_args_from(ns: argparse.Namespace, server_args_cls: type) -> Any:
    """The `ServerArgs` of the parsed flags (the API key falls back to $PAGODA_API_KEY)."""
    api_key: Any = ns.api_key if ns.api_key is not None else envs.api_key()
    if isinstance(api_key, list):
        api_key = api_key[0] if len(api_key) == 1 else tuple(api_key)
    names = ns.served_model_name
    if isinstance(names, list):
        names = names[0] if len(names) == 1 else tuple(names)
    if ns.max_logprobs > 20 or ns.max_logprobs < 0:
        raise ValueError(
            f"--max-logprobs {ns.max_logprobs}: pagoda computes 0 to 20 log-probs per token"
        )
    if (
        ns.max_cpu_loras is not None
        and ns.max_loras is not None
        and ns.max_cpu_loras < ns.max_loras
    ):
        raise ValueError("--max-cpu-loras must be >= --max-loras")
    kwargs: dict[str, Any] = dict(
        host=ns.host,
        port=ns.port,
        api_key=api_key,
        served_model_name=names,
        max_concurrent_requests=ns.max_concurrent_requests,
        shutdown_timeout=ns.shutdown_timeout,
        log_level=ns.log_level,
        uvicorn_log_level=ns.uvicorn_log_level,
        access_log=not ns.no_access_log,
        lora_modules=parse_lora_modules(ns.lora_modules),
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        max_cpu_loras=ns.max_cpu_loras,
        tool_call_parser=ns.tool_call_parser,
        gil_switch_interval_s=ns.gil_switch_interval,
        engine_mode=ns.engine_mode,
        restart_engine=ns.restart_engine,
        enable_log_requests=ns.enable_log_requests,
        max_log_len=ns.max_log_len,
        allowed_origins=tuple(ns.allowed_origins),
        allowed_methods=tuple(ns.allowed_methods),
        allowed_headers=tuple(ns.allowed_headers),
        allow_credentials=ns.allow_credentials,
        ssl_keyfile=ns.ssl_keyfile,
        ssl_certfile=ns.ssl_certfile,
        ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs,
        root_path=ns.root_path,
        disable_fastapi_docs=ns.disable_fastapi_docs,
        chat_template=ns.chat_template,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        reasoning_parser=ns.reasoning_parser,
        max_logprobs=ns.max_logprobs,
        generation_config=ns.generation_config,
        override_generation_config=ns.override_generation_config,
        data_parallel_size=getattr(ns, "data_parallel_size", 1),
    )
    if ns.max_body_bytes is not None:
        kwargs["max_body_bytes"] = ns.max_body_bytes
    return server_args_cls(**kwargs)

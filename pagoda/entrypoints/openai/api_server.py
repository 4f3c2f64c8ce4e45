"""The OpenAI-compatible HTTP server: a FastAPI app over one engine (its own process by default).

`build_app()` wires the endpoints, the ASGI guard (API key, body size, concurrency limit) and
the error handlers that turn every client mistake into an OpenAI-style 4xx. `run_server()` is
`pagoda serve`: it takes `EngineArgs` and `ServerArgs` built by the CLI and never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import __version__
from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import EngineDeadError
from pagoda.engine.data_parallel import DataParallelEngine
from pagoda.engine.engine_process import (
    ENGINE_MODES,
    RestartingEngine,
    ServerEngine,
    start_engine,
)
from pagoda.entrypoints.openai.errors import (
    APIError,
    error_response,
    param_of,
    validation_error,
)
from pagoda.entrypoints.openai.metrics import Metrics
from pagoda.entrypoints.openai.middleware import ServerGuard, ServerState
from pagoda.entrypoints.openai.protocol import ModelCard, ModelList
from pagoda.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_engine import ServingOptions
from pagoda.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagoda.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("pagoda")

DEFAULT_MAX_BODY_BYTES = 8 << 20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerArgs:
    """What `pagoda serve` needs beyond the engine: address, limits, names and adapters."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | tuple[str, ...] | None = None  # several: any of them
    # None: the model's own name; several: all are accepted, responses carry the first
    served_model_name: str | tuple[str, ...] | None = None
    max_concurrent_requests: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 10.0
    log_level: str = "info"
    access_log: bool = True
    lora_modules: dict[str, str] = field(default_factory=dict)  # served name -> adapter dir
    max_loras: int | None = None
    max_lora_rank: int = 64
    tool_call_parser: str | None = None  # None: chosen from the chat template
    # sys.setswitchinterval for the server process (None: Python's 5 ms). With
    # engine_mode="thread" the engine thread shares the GIL with the HTTP loop; each time it
    # releases the GIL (a device sync, a socket write) it may wait this long to get it back.
    gil_switch_interval_s: float | None = None
    # Where the engine loop runs: "process" (its own, so it holds its own GIL), "thread" (of
    # the server process) or "auto" (process where one can be started).
    engine_mode: str = "auto"
    # Engine processes behind this server (pagoda.engine.data_parallel); 1: one engine.
    data_parallel_size: int = 1
    # An engine process that dies: the server exits non-zero (False) or starts a new one (True).
    restart_engine: bool = False
    uvicorn_log_level: str | None = None  # None: log_level
    max_cpu_loras: int | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # CORS (vLLM's defaults: no cross-origin access; methods and headers: any)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    root_path: str | None = None
    disable_fastapi_docs: bool = False
    chat_template: str | None = None  # a file, or the template itself
    enable_auto_tool_choice: bool | None = None
    reasoning_parser: str | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    override_generation_config: dict | None = None

    @property
    def served_model_names(self) -> tuple[str, ...]:
        name = self.served_model_name
        if name is None:
            return ()
        return (name,) if isinstance(name, str) else tuple(name)

    @property
    def api_keys(self) -> tuple[str, ...]:
        key = self.api_key
        if not key:
            return ()
        return (key,) if isinstance(key, str) else tuple(key)

    def __post_init__(self) -> None:
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"--data-parallel-size must be an integer >= 1, got {dp!r}")
        if dp > 1 and self.engine_mode == "thread":
            raise ValueError(
                "--data-parallel-size > 1 runs engine processes: not --engine-mode thread"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(
                f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError(
                f"--gil-switch-interval must be > 0 seconds, got {self.gil_switch_interval_s}"
            )
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(
                f"--engine-mode must be one of {', '.join(ENGINE_MODES)}, got {self.engine_mode!r}"
            )
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for flag, path in (
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)

    def chat_template_text(self) -> str | None:
        """--chat-template: a file's text, or the argument itself when it is a template."""
        value = self.chat_template
        if value is None:
            return None
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return f.read()
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"--chat-template {value!r}: neither a file nor a Jinja template")

    def engine_overrides(self) -> dict[str, object]:
        """EngineArgs fields the server's options imply (LoRA serving)."""
        if not self.lora_modules:
            return {}
        kw: dict[str, object] = dict(
            enable_lora=True,
            max_loras=self.max_loras or min(len(self.lora_modules), 8),
            max_lora_rank=self.max_lora_rank,
        )
        if self.max_cpu_loras is not None:
            kw["max_cpu_loras"] = self.max_cpu_loras
        return kw


def build_app(
    async_engine: ServerEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_concurrent_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_modules: dict[str, str] | None = None,
    tool_call_parser: str | None = None,
    options: ServingOptions | None = None,
    cors: dict[str, object] | None = None,
    docs: bool = True,
    root_path: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. It does not own the engine: the caller shuts it down.

    `lora_modules` maps served names to PEFT adapter directories (the engine must have been
    built with `enable_lora=True`); a request's `model` field picks the adapter.
    `tool_call_parser` (hermes | llama3_json) overrides the parser chosen from the template.
    `options`: the vLLM flags' endpoint settings; `cors`: CORSMiddleware's arguments (None: no
    CORS headers); `docs`: /docs and /openapi.json; `root_path`: a reverse proxy's prefix.
    """
    options = options or ServingOptions()
    if max_concurrent_requests is not None and max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    metrics = Metrics(async_engine, served_model_name)
    lora_requests = {}
    if lora_modules:
        from pagoda.lora.request import LoRARequest

        for i, (name, path) in enumerate(lora_modules.items(), start=1):
            if name == served_model_name:
                raise ValueError(f"adapter name {name!r} is the base model's served name")
            lora_requests[name] = LoRARequest(name, i, path)
    for alias in options.aliases:
        if alias in lora_requests:
            raise ValueError(f"adapter name {alias!r} is also a served name of the base model")
    shared = (async_engine, served_model_name, metrics, lora_requests)
    completion = OpenAIServingCompletion(*shared, options=options)
    chat = OpenAIServingChat(*shared, tool_call_parser=tool_call_parser, options=options)
    responses = OpenAIServingResponses(*shared, tool_call_parser=tool_call_parser, options=options)
    tokenization = OpenAIServingTokenization(*shared, options=options)
    no_docs: dict[str, object] = (
        {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await chat.check_template()
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="pagoda",
        summary="OpenAI-compatible LLM server",
        version=__version__,
        root_path=root_path or "",
        **no_docs,
    )
    state = ServerState()
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
        err = validation_error(exc.errors())
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        if status == 404:
            return error_response(404, "no such endpoint", code="not_found")
        return error_response(status, str(exc.detail))

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def _bad_input(_: Request, exc: Exception) -> Response:
        message = str(exc) or type(exc).__name__
        return error_response(400, message, param_of(message))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_response(503, "the server is shutting down")
        if not async_engine.is_running:
            return error_response(503, "the engine is not running")
        dead = getattr(async_engine, "dead_replicas", list)()  # data parallel
        if dead:
            which = ", ".join(map(str, dead))
            return error_response(503, f"data-parallel replica(s) {which} not running")
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    def model_cards() -> list[ModelCard]:
        cards = [
            ModelCard(
                id=name,
                root=async_engine.model_name,
                max_model_len=async_engine.max_model_len,
            )
            for name in (served_model_name, *options.aliases)
        ]
        cards += [
            ModelCard(
                id=name,
                root=lr.lora_path,
                parent=served_model_name,
                max_model_len=async_engine.max_model_len,
            )
            for name, lr in lora_requests.items()
        ]
        return cards

    @app.get("/v1/models")
    async def models() -> Response:
        body = ModelList(data=model_cards()).model_dump_json()
        return Response(body, media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        for card in model_cards():
            if card.id == model_id:
                return Response(card.model_dump_json(), media_type="application/json")
        raise APIError(
            404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    @app.get("/v1/memory")
    async def memory() -> Response:
        s = async_engine.stats()
        report = async_engine.memory_report.to_dict()
        report["live"] = {
            "num_blocks": s.num_blocks,
            "num_free_blocks": s.num_free_blocks,
            "kv_cache_usage": s.kv_cache_usage,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_unfinished": s.num_unfinished,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        }
        return JSONResponse(report)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion.create(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenization.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return await tokenization.tokenizer_info()

    app.add_middleware(
        ServerGuard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_concurrent_requests=max_concurrent_requests,
        state=state,
    )
    if cors is not None:  # outermost: a browser's preflight is answered before the API key check
        app.add_middleware(CORSMiddleware, **cors)
    return app


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """`pagoda serve`: load the model, serve until SIGINT/SIGTERM, then shut down cleanly.

    Returns the process's exit code: 0 after a signal, 1 when the engine process died (and
    --restart-engine was not given), so that systemd, Kubernetes or Docker restart the server.
    """
    import uvicorn

    from pagoda.entrypoints.openai.generation_config import sampling_defaults

    level = getattr(logging, server_args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagoda").setLevel(level)
    if server_args.gil_switch_interval_s is not None:
        sys.setswitchinterval(server_args.gil_switch_interval_s)
    chat_template = server_args.chat_template_text()  # a bad path fails before the model loads
    if server_args.data_parallel_size > 1:
        if server_args.restart_engine:
            raise ValueError("--restart-engine works with one engine (--data-parallel-size 1)")
        engine: Any = DataParallelEngine(engine_args, server_args.data_parallel_size)
    else:
        engine = start_engine(engine_args, server_args.engine_mode)
    if server_args.restart_engine:
        if not engine.runs_in_process:
            engine.shutdown()
            raise ValueError("--restart-engine needs the engine in its own process")
        engine = RestartingEngine(engine, lambda: start_engine(engine_args, "process"))
    try:
        names = server_args.served_model_names or (engine.model_name,)
        where = "in its own process" if engine.runs_in_process else "in a thread"
        print(
            f"pagoda: {engine.model_name} ready in {engine.startup_time_s:.1f} s (engine "
            f"{where}), served as {', '.join(repr(n) for n in names)}\n{engine.memory_report}",
            file=sys.stderr,
        )
        options = ServingOptions(
            aliases=tuple(names[1:]),
            chat_template=chat_template,
            enable_auto_tool_choice=server_args.enable_auto_tool_choice,
            reasoning_parser=server_args.reasoning_parser,
            max_logprobs=server_args.max_logprobs,
            sampling_defaults=sampling_defaults(
                server_args.generation_config,
                _model_dir(engine),
                server_args.override_generation_config,
            ),
            log_requests=server_args.enable_log_requests,
            max_log_len=server_args.max_log_len,
        )
        cors = dict(
            allow_origins=list(server_args.allowed_origins),
            allow_credentials=server_args.allow_credentials,
            allow_methods=list(server_args.allowed_methods),
            allow_headers=list(server_args.allowed_headers),
        )
        app = build_app(
            engine,
            names[0],
            api_key=server_args.api_key,
            max_concurrent_requests=server_args.max_concurrent_requests,
            max_body_bytes=server_args.max_body_bytes,
            lora_modules=server_args.lora_modules,
            tool_call_parser=server_args.tool_call_parser,
            options=options,
            cors=cors,
            docs=not server_args.disable_fastapi_docs,
            root_path=server_args.root_path,
        )
        ssl: dict[str, object] = {}
        if server_args.ssl_keyfile is not None:
            ssl = dict(
                ssl_keyfile=server_args.ssl_keyfile,
                ssl_certfile=server_args.ssl_certfile,
                ssl_ca_certs=server_args.ssl_ca_certs,
                ssl_cert_reqs=server_args.ssl_cert_reqs,
            )
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.uvicorn_log_level or server_args.log_level,
            access_log=server_args.access_log,
            timeout_graceful_shutdown=server_args.shutdown_timeout,
            **ssl,
        )
        server = _DrainingServer(config, app.state.server, server_args.shutdown_timeout)
        watchdog = _EngineWatchdog(engine, server, server_args.restart_engine)
        watchdog.start()
        server.run()  # SIGINT / SIGTERM: drains (new requests 503), then returns
        watchdog.stop()
    finally:
        engine.shutdown()
    if watchdog.engine_died:
        print("pagoda: the engine process died; exiting with status 1", file=sys.stderr)
        return 1
    return 0


class _DrainingServer:
    """uvicorn's server, with a graceful SIGTERM: /health and new generation requests answer
    503 at once (a load balancer takes the replica out), in-flight ones finish (at most
    `timeout` seconds), then the server stops. A second signal stops it without waiting."""

    def __new__(cls, config: object, state: ServerState, timeout: float) -> object:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: object) -> None:
                if state.draining or sig not in (signal.SIGTERM, signal.SIGINT):
                    super().handle_exit(sig, frame)
                    return
                state.draining = True
                logger.info("draining: %d request(s) in flight, new ones get 503", state.in_flight)
                threading.Thread(target=self._drain, name="pagoda-drain", daemon=True).start()

            def _drain(self) -> None:
                deadline = time.monotonic() + timeout
                while state.in_flight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.should_exit = True

        return Server(config)


class _EngineWatchdog:
    """Watches the engine process: when it dies, the server exits (status 1) or, with
    --restart-engine, a new engine is started while requests get 503."""

    def __init__(self, engine: object, server: object, restart: bool) -> None:
        self.engine = engine
        self.server = server
        self.restart = restart
        self.engine_died = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            engine = self.engine
            if engine.is_running or getattr(engine, "stopping", False):
                continue
            if getattr(self.server, "should_exit", False):
                return
            if not self.restart:
                logger.error("the engine process died; stopping the server (exit status 1)")
                self.engine_died = True
                self.server.should_exit = True
                return
            try:
                engine.restart()
            except Exception:
                logger.exception("restarting the engine failed; stopping the server")
                self.engine_died = True
                self.server.should_exit = True
                return


def _model_dir(engine: object) -> str | None:
    """Where the served model's files are (its generation_config.json), either engine kind."""
    frontend = getattr(engine, "frontend", None) or getattr(engine, "engine", None)
    source = getattr(frontend, "source", None)
    return None if source is None else str(source.path)

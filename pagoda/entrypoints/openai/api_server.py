"""The OpenAI-compatible HTTP server: a FastAPI app over one engine (its own process by default).

`build_app()` wires the endpoints, the ASGI guard (API key, body size, concurrency limit) and
the error handlers that turn every client mistake into an OpenAI-style 4xx. `run_server()` is
`pagoda serve`: it takes `EngineArgs` and `ServerArgs` built by the CLI and never imports it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import __version__
from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import EngineDeadError
from pagoda.engine.data_parallel import DataParallelEngine
from pagoda.engine.engine_process import ENGINE_MODES, ServerEngine, start_engine
from pagoda.entrypoints.openai.errors import (
    APIError,
    error_response,
    param_of,
    validation_error,
)
from pagoda.entrypoints.openai.metrics import Metrics
from pagoda.entrypoints.openai.middleware import ServerGuard
from pagoda.entrypoints.openai.protocol import ModelCard, ModelList
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("pagoda")

DEFAULT_MAX_BODY_BYTES = 8 << 20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerArgs:
    """What `pagoda serve` needs beyond the engine: address, limits, names and adapters."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model's own name
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

    def engine_overrides(self) -> dict[str, object]:
        """EngineArgs fields the server's options imply (LoRA serving)."""
        if not self.lora_modules:
            return {}
        return dict(
            enable_lora=True,
            max_loras=self.max_loras or min(len(self.lora_modules), 8),
            max_lora_rank=self.max_lora_rank,
        )


def build_app(
    async_engine: ServerEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_concurrent_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_modules: dict[str, str] | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. It does not own the engine: the caller shuts it down.

    `lora_modules` maps served names to PEFT adapter directories (the engine must have been
    built with `enable_lora=True`); a request's `model` field picks the adapter.
    `tool_call_parser` (hermes | llama3_json) overrides the parser chosen from the template.
    """
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
    shared = (async_engine, served_model_name, metrics, lora_requests)
    completion = OpenAIServingCompletion(*shared)
    chat = OpenAIServingChat(*shared, tool_call_parser=tool_call_parser)
    tokenization = OpenAIServingTokenization(*shared)
    app = FastAPI(title="pagoda", summary="OpenAI-compatible LLM server", version=__version__)
    app.state.engine = async_engine
    app.state.metrics = metrics

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
                id=served_model_name,
                root=async_engine.model_name,
                max_model_len=async_engine.max_model_len,
            )
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
    )
    return app


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """`pagoda serve`: load the model, serve until SIGINT/SIGTERM, then shut down cleanly."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if server_args.gil_switch_interval_s is not None:
        sys.setswitchinterval(server_args.gil_switch_interval_s)
    if server_args.data_parallel_size > 1:
        engine: Any = DataParallelEngine(engine_args, server_args.data_parallel_size)
    else:
        engine = start_engine(engine_args, server_args.engine_mode)
    try:
        name = server_args.served_model_name or engine.model_name
        where = "in its own process" if engine.runs_in_process else "in a thread"
        print(
            f"pagoda: {engine.model_name} ready in {engine.startup_time_s:.1f} s (engine "
            f"{where}), served as {name!r}\n{engine.memory_report}",
            file=sys.stderr,
        )
        app = build_app(
            engine,
            name,
            api_key=server_args.api_key,
            max_concurrent_requests=server_args.max_concurrent_requests,
            max_body_bytes=server_args.max_body_bytes,
            lora_modules=server_args.lora_modules,
            tool_call_parser=server_args.tool_call_parser,
        )
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level,
            access_log=server_args.access_log,
            timeout_graceful_shutdown=server_args.shutdown_timeout,
        )
        uvicorn.Server(config).run()  # handles SIGINT / SIGTERM: drains, then returns
    finally:
        engine.shutdown()
    return 0

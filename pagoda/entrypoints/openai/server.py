"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLMEngine`.

`build_app()` wires the endpoints (/v1/models, /v1/completions, /v1/chat/completions, /health,
/metrics, /v1/memory), an ASGI guard (API key, body size, concurrency limit) and error handlers
that turn every client mistake into an OpenAI-style 4xx. `run_server()` is `pagoda serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_text
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbContent,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from pagoda.outputs import Logprob, RequestOutput

logger = logging.getLogger("pagoda")

DEFAULT_MAX_BODY_BYTES = 8 << 20
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# fmt: off
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)
# fmt: on
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with OpenAI's error JSON and `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    info = ErrorInfo(
        message=message,
        type=_STATUS_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return ErrorResponse(error=info).model_dump_json().encode()


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        _error_body(status, message, param, code), status, media_type="application/json"
    )


_PARAM_PREFIX = re.compile(r"^([a-z_][a-z0-9_.]*)(?:: | must )")


def _param_of(message: str) -> str | None:
    """`"stop: at most 16 ..."` → `"stop"`: validation messages start with the field's name."""
    m = _PARAM_PREFIX.match(message)
    return m.group(1) if m else None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validation_error(errors: Sequence[Any]) -> APIError:
    """One readable 400 out of pydantic's error list."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if loc and loc[0] == "prompt":
        return APIError(
            400,
            "prompt: must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {_short(first.get('input'))}",
            param="prompt",
        )
    messages = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "missing":
            messages.append(f"{where}: field required")
        elif err.get("type") == "model_type" and not where:
            messages.append(f"the body must be a JSON object, got {_short(err.get('input'))}")
        elif where:
            messages.append(f"{where}: {msg} (got {_short(err.get('input'))})")
        else:
            messages.append(msg)
    message = "; ".join(messages)
    param = ".".join(loc) if loc else _param_of(message)
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------- ASGI guard


class _Guard:
    """Checks every HTTP request before the app sees it: API key, body size, concurrency.

    The body is read here, up to `max_body_bytes`, and replayed to the app, so that an
    oversized body is refused (413) whether or not it declares a Content-Length.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        api_key: str | None,
        max_body_bytes: int,
        max_concurrent_requests: int | None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent_requests
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await _send_error(
                    send,
                    401,
                    "invalid or missing API key (use 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                )
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            declared = headers.get(b"content-length")
            if declared is not None:
                try:
                    size = int(declared)
                except ValueError:
                    await _send_error(send, 400, "invalid Content-Length header")
                    return
                if size > self.max_body_bytes:
                    await _send_too_large(send, self.max_body_bytes, size)
                    return
            chunks = []
            total = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                total += len(chunk)
                if total > self.max_body_bytes:
                    await _send_too_large(send, self.max_body_bytes, None)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            receive = _replay(b"".join(chunks), receive)
        if path in GENERATION_PATHS and self.max_concurrent is not None:
            if self.in_flight >= self.max_concurrent:
                await _send_error(
                    send,
                    429,
                    f"the server is at its limit of {self.max_concurrent} concurrent requests; "
                    "retry later",
                    code="rate_limit_exceeded",
                )
                return
            self.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight -= 1
            return
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(
    send: Callable, status: int, message: str, param: str | None = None, code: str | None = None
) -> None:
    body = _error_body(status, message, param, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_too_large(send: Callable, limit: int, size: int | None) -> None:
    got = f" ({size} bytes)" if size is not None else ""
    await _send_error(
        send,
        413,
        f"the request body is too large{got}: the limit is {limit} bytes",
        code="request_too_large",
    )


# ---------------------------------------------------------------------------- metrics


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        labels = [self.model_name]
        gauges = [
            ("pagoda_num_requests_running", "Samples being computed.", s.num_running),
            ("pagoda_num_requests_waiting", "Samples waiting for a slot.", s.num_waiting),
            (
                "pagoda_kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1).",
                s.kv_cache_usage,
            ),
            ("pagoda_kv_cache_free_blocks", "Free KV cache blocks.", s.num_free_blocks),
            ("pagoda_kv_cache_total_blocks", "Usable KV cache blocks.", s.num_blocks),
            (
                "pagoda_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache (fraction, since start-up).",
                s.prefix_cache_hit_rate,
            ),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        counters = [
            (
                "pagoda_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "pagoda_prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                s.prefix_cache_hits,
            ),
            ("pagoda_engine_steps", "Engine steps (batches) run.", s.num_steps),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c


class _Metrics:
    """Everything /metrics shows, in a private registry (several apps may share a process)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        reg = dict(registry=self.registry, labelnames=["model_name"])
        self.ttft = Histogram(
            "pagoda_time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            **reg,
        ).labels(model_name)
        self.itl = Histogram(
            "pagoda_inter_token_latency_seconds",
            "Time between two outputs of a request.",
            buckets=_LATENCY_BUCKETS,
            **reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "pagoda_e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            **reg,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "pagoda_prompt_tokens", "Prompt tokens of admitted requests.", **reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "pagoda_generation_tokens", "Generated tokens.", **reg
        ).labels(model_name)
        self._finished = Counter(
            "pagoda_requests_finished",
            "Finished requests (samples) by finish reason; abort: the client left.",
            registry=self.registry,
            labelnames=["model_name", "finish_reason"],
        )
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return prometheus_text(self.registry)


class _Tracker:
    """Times one engine request as its consumer sees it and feeds the histograms."""

    def __init__(self, metrics: _Metrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last_token: float | None = None
        self.prompt_counted = False
        self.finished = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        m = self.metrics
        if not self.prompt_counted:
            self.prompt_counted = True
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if self.last_token is None:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last_token)
            self.last_token = now
            m.generation_tokens.inc(new_tokens)
        if out.finished:
            self.finished = True
            m.e2e.observe(now - self.arrival)
            for c in out.outputs:
                m.finished(c.finish_reason or "unknown")

    def close(self) -> None:
        """The consumer is done: a request that did not finish was aborted (client left)."""
        if not self.finished:
            self.finished = True
            self.metrics.finished("abort")


# ---------------------------------------------------------------------------- streaming


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, as soon as the client leaves."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def pump() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for event in self._events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        listen_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump_task, listen_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, listen_task):
                task.cancel()
            await asyncio.gather(pump_task, listen_task, return_exceptions=True)
            await self._events.aclose()  # type: ignore[attr-defined]
        if not pump_task.cancelled() and pump_task.exception() is not None:
            exc = pump_task.exception()
            if not isinstance(exc, OSError):  # a write to a closed socket is a disconnect
                logger.warning("streaming response failed: %r", exc)


async def _wait_for_disconnect(receive: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client disconnects first (returns None then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def _merge(
    streams: Sequence[RequestStream], trackers: Sequence[_Tracker]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, tagged with the stream's index.

    Each output is timed by its stream's tracker; leaving early aborts the unfinished streams.
    """
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                trackers[0].observe(out)
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    trackers[i].observe(item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for stream, tracker in zip(streams, trackers, strict=True):
            stream.abort()
            tracker.close()


def _sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


_DONE = "data: [DONE]\n\n"
# Left out of responses unless the request sets return_token_ids.
_NO_TOKEN_IDS = {"choices": {"__all__": {"prompt_token_ids", "token_ids"}}}


def _dump(body: BaseModel, token_ids: bool) -> Response:
    text = body.model_dump_json(exclude=None if token_ids else _NO_TOKEN_IDS)
    return Response(text, media_type="application/json")


# ---------------------------------------------------------------------------- choices


@dataclass
class _Choice:
    """One choice accumulated from delta outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # by stream

    def add(self, stream_index: int, out: RequestOutput) -> None:
        if stream_index not in self.prompt_ids:
            self.prompt_ids[stream_index] = out.prompt_token_ids
            self.prompt_tokens += len(out.prompt_token_ids)
        if out.finished:
            self.cached_tokens += out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def _sampled_entry(entry: dict[int, Logprob], token_id: int | None) -> tuple[int, Logprob]:
    if token_id is not None and token_id in entry:
        return token_id, entry[token_id]
    return next(iter(entry.items()))  # the sampled token is always inserted first


def _completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], offset: int, k: int
) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for i, entry in enumerate(logprobs):
        tid, lp = _sampled_entry(entry, token_ids[i] if i < len(token_ids) else None)
        token = lp.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(token)
        top: dict[str, float] = {}
        for other in sorted(entry.values(), key=lambda x: -x.logprob)[: max(k, 1)]:
            top.setdefault(other.decoded_token or "", other.logprob)
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
    return out


def _chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], k: int
) -> ChatChoiceLogProbs:
    content = []
    for i, entry in enumerate(logprobs):
        _, lp = _sampled_entry(entry, token_ids[i] if i < len(token_ids) else None)
        token = lp.decoded_token or ""
        top = [
            ChatLogProb(
                token=o.decoded_token or "",
                logprob=o.logprob,
                bytes=list((o.decoded_token or "").encode()),
            )
            for o in sorted(entry.values(), key=lambda x: -x.logprob)[:k]
        ]
        content.append(
            ChatLogProbContent(
                token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatChoiceLogProbs(content=content)


def _check_stop_token_ids(ids: Sequence[int] | None, vocab_size: int) -> None:
    # Checked here because an id outside the vocabulary would fail the whole batch's step
    # (the min_tokens mask indexes the logits with it).
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            param="stop_token_ids",
        )


def _max_tokens(prompt_len: int, requested: int | None, default: int | None, limit: int) -> int:
    """The max_tokens to use; a request beyond the context is a 400 that states the numbers."""
    room = limit - prompt_len  # >= 1: the input processor keeps one token free
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


# ---------------------------------------------------------------------------- endpoints


class _OpenAIServing:
    """The completion and chat endpoints over one engine."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        metrics: _Metrics,
        lora_requests: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.lora_requests = lora_requests or {}

    def check_model(self, model: str) -> Any:
        """The LoRARequest the model name selects (None for the base model), or 404."""
        if model == self.model_name:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        names = ", ".join(repr(n) for n in [self.model_name, *self.lora_requests])
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )

    async def _add(
        self, prepare: Callable[[LLMEngine], list], request_id: str, lora: Any = None
    ) -> Any:
        if lora is not None:
            inner = prepare

            def prepare(engine: LLMEngine) -> list:
                return [(*item, lora) for item in inner(engine)]

        try:
            return await self.engine.add_requests(prepare, request_id)
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e

    # -- /v1/completions ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        lora = self.check_model(req.model)
        prompts = req.prompt_list()
        explicit = "max_tokens" in req.model_fields_set
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)  # validate before touching the engine
        echo_texts: list[str] = []

        def prepare(engine: LLMEngine) -> list:
            _check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            items = []
            echo_texts.clear()
            for prompt in prompts:
                processed = engine.input_processor.process(prompt)
                n_prompt = len(processed.prompt_token_ids)
                requested = req.max_tokens if explicit else None
                default = None if explicit else 16
                params = req.to_sampling_params(_max_tokens(n_prompt, requested, default, limit))
                if req.echo:
                    text = processed.prompt
                    if text is None:
                        if engine.tokenizer is None:
                            raise ValueError("echo: needs a tokenizer to show token-id prompts")
                        text = engine.tokenizer.decode(processed.prompt_token_ids)
                    echo_texts.append(text)
                items.append((processed, params))
            return items

        rid = random_id("cmpl")
        arrival = time.perf_counter()
        streams = await self._add(prepare, rid, lora)
        trackers = [_Tracker(self.metrics, arrival) for _ in streams]
        if req.stream:
            return _EventStream(self._stream_completion(req, rid, streams, trackers, echo_texts))
        result = await _unless_disconnected(request, _collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        choices_by_stream, usage = result
        choices = []
        for i, per_stream in enumerate(choices_by_stream):
            for j, ch in enumerate(per_stream):
                prefix = echo_texts[i] if req.echo else ""
                text = prefix + "".join(ch.text)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = _completion_logprobs(
                        ch.token_ids, ch.logprobs, len(prefix), req.logprobs
                    )
                choices.append(
                    CompletionChoice(
                        index=i * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=ch.finish_reason,
                        stop_reason=ch.stop_reason,
                        prompt_token_ids=usage.prompt_ids.get(i),
                        token_ids=ch.token_ids,
                    )
                )
        body = CompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=usage.info()
        )
        return _dump(body, req.return_token_ids)

    async def _stream_completion(
        self,
        req: CompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[_Tracker],
        echo_texts: list[str],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = _Usage()
        offsets = [[len(echo_texts[i]) if req.echo else 0] * req.n for i in range(len(streams))]
        done: set[int] = set()
        ids_wanted = req.return_token_ids

        def chunk(
            index: int,
            text: str,
            logprobs: Any = None,
            finish: Any = None,
            stop: Any = None,
            token_ids: list[int] | None = None,
        ) -> str:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": stop,
            }
            if req.return_token_ids:
                choice["token_ids"] = token_ids or []
            return _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                    **({"usage": None} if req.include_usage else {}),
                }
            )

        try:
            if req.echo:
                for i in range(len(streams)):
                    for j in range(req.n):
                        yield chunk(i * req.n + j, echo_texts[i])
            async for i, out in _merge(streams, trackers):
                usage.add(i, out)
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    lp = None
                    if req.logprobs is not None and c.logprobs:
                        lp = _completion_logprobs(
                            c.token_ids, c.logprobs, offsets[i][c.index], req.logprobs
                        ).model_dump()
                    offsets[i][c.index] += len(c.text)
                    if c.finish_reason is not None:
                        done.add(index)
                    elif not c.text and lp is None and not (ids_wanted and c.token_ids):
                        continue
                    yield chunk(index, c.text, lp, c.finish_reason, c.stop_reason, c.token_ids)
            if req.include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage.info().model_dump(),
                    }
                )
        except Exception as e:
            yield _stream_error(e)
        yield _DONE

    # -- /v1/chat/completions ----------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        lora = self.check_model(req.model)
        messages = [m.to_dict() for m in req.messages]
        requested = req.requested_max_tokens
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)

        def prepare(engine: LLMEngine) -> list:
            from jinja2 import TemplateError

            _check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            try:
                processed = engine.input_processor.process_chat(
                    messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                )
            except TemplateError as e:
                raise ValueError(f"messages: the model's chat template rejected them: {e}") from e
            n_prompt = len(processed.prompt_token_ids)
            params = req.to_sampling_params(_max_tokens(n_prompt, requested, None, limit))
            return [(processed, params)]

        rid = random_id("chatcmpl")
        arrival = time.perf_counter()
        streams = await self._add(prepare, rid, lora)
        trackers = [_Tracker(self.metrics, arrival)]
        k = req.top_logprobs or 0
        if req.stream:
            return _EventStream(self._stream_chat(req, rid, streams, trackers))
        result = await _unless_disconnected(request, _collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        (per_stream,), usage = result
        choices = [
            ChatCompletionChoice(
                index=j,
                message=ChatResponseMessage(content="".join(ch.text)),
                logprobs=_chat_logprobs(ch.token_ids, ch.logprobs, k) if req.logprobs else None,
                finish_reason=ch.finish_reason,
                stop_reason=ch.stop_reason,
                prompt_token_ids=usage.prompt_ids.get(0),
                token_ids=ch.token_ids,
            )
            for j, ch in enumerate(per_stream)
        ]
        body = ChatCompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=usage.info()
        )
        return _dump(body, req.return_token_ids)

    async def _stream_chat(
        self,
        req: ChatCompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[_Tracker],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = _Usage()
        k = req.top_logprobs or 0
        done: set[int] = set()
        ids_wanted = req.return_token_ids

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=rid, created=created, model=self.model_name, choices=[choice]
            ).model_dump(exclude={"usage"} if not req.include_usage else set())
            for c in body["choices"]:
                c["delta"] = {key: v for key, v in c["delta"].items() if v is not None}
                if not ids_wanted:
                    del c["token_ids"]
            return _sse(body)

        try:
            for j in range(req.n):
                yield chunk(
                    ChatCompletionStreamChoice(
                        index=j, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            async for _, out in _merge(streams, trackers):
                usage.add(0, out)
                for c in out.outputs:
                    if c.index in done:
                        continue
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = _chat_logprobs(c.token_ids, c.logprobs, k)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    elif not c.text and lp is None and not (ids_wanted and c.token_ids):
                        continue
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text or None),
                            logprobs=lp,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=c.token_ids if ids_wanted else None,
                        )
                    )
            if req.include_usage:
                yield _sse(
                    ChatCompletionStreamResponse(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage.info(),
                    )
                )
        except Exception as e:
            yield _stream_error(e)
        yield _DONE


async def _collect(
    streams: list[RequestStream], trackers: list[_Tracker], n: int
) -> tuple[list[list[_Choice]], _Usage]:
    choices = [[_Choice() for _ in range(n)] for _ in streams]
    usage = _Usage()
    async for i, out in _merge(streams, trackers):
        usage.add(i, out)
        for c in out.outputs:
            ch = choices[i][c.index]
            ch.text.append(c.text)
            ch.token_ids.extend(c.token_ids)
            if c.logprobs:
                ch.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
    return choices, usage


def _stream_error(e: Exception) -> str:
    """An error after the 200 header went out: sent as an event, as OpenAI's API does."""
    if isinstance(e, APIError):
        status, message = e.status, e.message
    elif isinstance(e, EngineDeadError):
        status, message = 503, str(e)
    else:
        logger.error("stream failed: %r", e)
        status, message = 500, f"internal error: {e}"
    info = ErrorInfo(message=message, type=_STATUS_TYPES.get(status, "server_error"))
    return _sse(ErrorResponse(error=info))


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    content_type = request.headers.get("content-type", "application/json")
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime and mime != "application/json" and not mime.endswith("+json"):
        raise APIError(400, f"Content-Type must be application/json, got {content_type!r}")
    body = await request.body()
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e.errors(include_url=False)) from None


# ---------------------------------------------------------------------------- the app


def build_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_concurrent_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. It does not own the engine: the caller shuts it down.

    `lora_modules` maps served names to PEFT adapter directories (the engine must have been
    built with `enable_lora=True`); a request's `model` field picks the adapter.
    """
    if max_concurrent_requests is not None and max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    metrics = _Metrics(async_engine, served_model_name)
    lora_requests = {}
    if lora_modules:
        from pagoda.lora.request import LoRARequest

        for i, (name, path) in enumerate(lora_modules.items(), start=1):
            if name == served_model_name:
                raise ValueError(f"adapter name {name!r} is the base model's served name")
            lora_requests[name] = LoRARequest(name, i, path)
    serving = _OpenAIServing(async_engine, served_model_name, metrics, lora_requests)
    app = FastAPI(title="pagoda", summary="OpenAI-compatible LLM server", version="0.1.0")
    app.state.engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
        err = _validation_error(exc.errors())
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
        return error_response(400, message, _param_of(message))

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
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
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
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

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
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    app.add_middleware(
        _Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_concurrent_requests=max_concurrent_requests,
    )
    return app


def run_server(args: argparse.Namespace) -> int:
    """`pagoda serve`: load the model, serve until SIGINT/SIGTERM, then shut down cleanly."""
    import uvicorn

    from pagoda.engine.args import EngineArgs
    from pagoda.entrypoints.cli import engine_kwargs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pagoda.entrypoints.openai.cli import parse_lora_modules

    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    kwargs = engine_kwargs(args)
    if lora_modules:
        kwargs.update(
            enable_lora=True,
            max_loras=args.max_loras or min(len(lora_modules), 8),
            max_lora_rank=args.max_lora_rank,
        )
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**kwargs))
    try:
        name = args.served_model_name or engine.model_name
        print(
            f"pagoda: {engine.model_name} ready in {engine.engine.startup_time_s:.1f} s, "
            f"served as {name!r}\n{engine.memory_report}",
            file=sys.stderr,
        )
        app = build_app(
            engine,
            name,
            api_key=args.api_key,
            max_concurrent_requests=args.max_concurrent_requests,
            max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
            lora_modules=lora_modules,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        uvicorn.Server(config).run()  # handles SIGINT / SIGTERM: drains, then returns
    finally:
        engine.shutdown()
    return 0

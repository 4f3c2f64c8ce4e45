"""Streaming plumbing: server-sent events, client-disconnect watching, merged output streams.

`EventStream` writes SSE and closes its source (aborting the engine requests) as soon as the
client leaves; `merge` interleaves the delta outputs of several engine requests (one per prompt)
as they arrive, timing each with its tracker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagoda.engine.async_engine import EngineDeadError, RequestStream
from pagoda.entrypoints.openai.errors import STATUS_TYPES, APIError
from pagoda.entrypoints.openai.metrics import RequestTracker
from pagoda.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagoda.outputs import RequestOutput

logger = logging.getLogger("pagoda")


class EventStream(StreamingResponse):
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
        listen_task = asyncio.ensure_future(wait_for_disconnect(receive))
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


async def wait_for_disconnect(receive: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client disconnects first (returns None then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
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


async def merge(
    streams: Sequence[RequestStream], trackers: Sequence[RequestTracker]
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


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


DONE = "data: [DONE]\n\n"
# Left out of responses unless the request sets return_token_ids.
NO_TOKEN_IDS = {"choices": {"__all__": {"prompt_token_ids", "token_ids"}}}


def dump(body: BaseModel, token_ids: bool) -> Response:
    text = body.model_dump_json(exclude=None if token_ids else NO_TOKEN_IDS)
    return Response(text, media_type="application/json")


def stream_error(e: Exception) -> str:
    """An error after the 200 header went out: sent as an event, as OpenAI's API does."""
    if isinstance(e, APIError):
        status, message = e.status, e.message
    elif isinstance(e, EngineDeadError):
        status, message = 503, str(e)
    else:
        logger.error("stream failed: %r", e)
        status, message = 500, f"internal error: {e}"
    info = ErrorInfo(message=message, type=STATUS_TYPES.get(status, "server_error"))
    return sse(ErrorResponse(error=info))

"""The ASGI guard in front of the app: API key, body size and the concurrency limit.

It answers 401 / 413 / 429 itself, before FastAPI parses anything, so that a flood of
oversized or unauthenticated requests costs no JSON parsing and never reaches the engine.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from pagoda.entrypoints.openai.errors import error_body

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class ServerState:
    """What the guard and the shutdown share: in-flight generation requests, and whether the
    server drains (SIGTERM: those finish, new ones get 503)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False


class ServerGuard:
    """Checks every HTTP request before the app sees it: API key, body size, concurrency.

    The body is read here, up to `max_body_bytes`, and replayed to the app, so that an
    oversized body is refused (413) whether or not it declares a Content-Length.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        api_key: str | tuple[str, ...] | None,
        max_body_bytes: int,
        max_concurrent_requests: int | None,
        state: ServerState | None = None,
    ) -> None:
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.api_keys = [k.encode() for k in keys if k]
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent_requests
        self.state = state or ServerState()

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.api_keys and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            token = token.strip()
            # every key is compared (no early exit), so timing does not tell which one matched
            ok = [hmac.compare_digest(token, key) for key in self.api_keys]
            if scheme.lower() != b"bearer" or not any(ok):
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
        if path in GENERATION_PATHS:
            if self.state.draining:
                await _send_error(
                    send, 503, "the server is shutting down; retry on another replica"
                )
                return
            if self.max_concurrent is not None and self.state.in_flight >= self.max_concurrent:
                await _send_error(
                    send,
                    429,
                    f"the server is at its limit of {self.max_concurrent} concurrent requests; "
                    "retry later",
                    code="rate_limit_exceeded",
                )
                return
            self.state.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.in_flight -= 1
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
    body = error_body(status, message, param, code)
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

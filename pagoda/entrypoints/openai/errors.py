"""OpenAI-shaped errors: `APIError`, the JSON error body, and pydantic errors made readable.

Every client mistake the server sees ends here as a 4xx with `{"error": {message, type, param,
code}}`; `param` names the offending field (validation messages start with the field's name).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi.responses import Response

from pagoda.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

STATUS_TYPES = {
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


def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    info = ErrorInfo(
        message=message,
        type=STATUS_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return ErrorResponse(error=info).model_dump_json().encode()


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(error_body(status, message, param, code), status, media_type="application/json")


_PARAM_PREFIX = re.compile(r"^([a-z_][a-z0-9_.]*)(?:: | must )")


def param_of(message: str) -> str | None:
    """`"stop: at most 16 ..."` → `"stop"`: validation messages start with the field's name."""
    m = _PARAM_PREFIX.match(message)
    return m.group(1) if m else None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error(errors: Sequence[Any]) -> APIError:
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
    param = ".".join(loc) if loc else param_of(message)
    return APIError(400, message, param=param)

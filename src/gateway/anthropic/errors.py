"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}, "request_id"}``, by HTTP status.

The gateway decides every failure once, as an ``APIError`` with an HTTP status (``gateway.errors``); on the
Messages routes it is written in Anthropic's words instead of OpenAI's. The types are those of the ``anthropic``
SDK's ``ErrorType``, so its clients raise the error class they expect.
"""

from __future__ import annotations

from typing import Any

import orjson

MESSAGES_PATH = "/v1/messages"
"""The routes whose errors are Anthropic-shaped: ``/v1/messages`` and ``/v1/messages/count_tokens``."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error type for each status the gateway answers with; other 4xx are ``invalid_request_error`` (a
413 too: the SDK knows no ``request_too_large`` type), other 5xx ``api_error``. An overloaded or unavailable backend
keeps the gateway's 503 (with ``Retry-After``), typed ``overloaded_error``: Anthropic's own 529 is the same error,
and the SDK and Claude Code retry both."""


def speaks_anthropic(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def error_object(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_body(status: int, message: str, request_id: str | None = None) -> bytes:
    return orjson.dumps(error_object(status, message, request_id))

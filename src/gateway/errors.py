"""The one place where failures become HTTP statuses and OpenAI-shaped error bodies."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from backends.errors import (
    BackendError,
    BackendTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    SlowClientError,
    UnavailableError,
    UpstreamError,
)
from gateway.openai.protocol import UnsupportedParameter

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the gateway itself decides on (bad body, body too large, unknown route)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_payload(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_error_from_backend(exc: BackendError) -> APIError:
    """Maps the backends' typed errors to HTTP (see design.md, rule 4)."""
    retry = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(max(1, round(retry)))} if retry is not None else {}
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, exc.message, param="model", code=exc.code or "model_not_found")
    if isinstance(exc, SlowClientError):
        return APIError(408, exc.message, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, OverloadedError | UnavailableError):
        return APIError(503, exc.message, type="server_error", code=exc.code or "service_unavailable", headers=headers)
    if isinstance(exc, BackendTimeoutError):
        return APIError(504, exc.message, type="server_error", code=exc.code)
    if isinstance(exc, UpstreamError):
        return APIError(502, exc.message, type="server_error", code=exc.code or "upstream_error")
    return APIError(500, exc.message, type="server_error", code=exc.code)


def error_response(error: APIError) -> Response:
    body = orjson.dumps(error_payload(error.message, error.type, error.param, error.code))
    return Response(body, status_code=error.status, media_type="application/json", headers=error.headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation problem as OpenAI words it: a message and the offending parameter."""
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = _param_path(loc)
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request. The body must be valid JSON.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    error = (first.get("ctx") or {}).get("error")
    if isinstance(error, UnsupportedParameter):
        return f"Unsupported value for '{error.param}': {error.why}", error.param
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if param:
        return f"Invalid value for '{param}': {message}", param
    return message, None


def _param_path(loc: list[int | str]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "tagged-union", "list[", "str", "int", "float", "bool")):
            continue  # pydantic's union-branch labels are not parameter names
        else:
            out += f".{part}" if out else str(part)
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_backend_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BackendError)
        return error_response(api_error_from_backend(exc))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "The server had an error processing your request.", type="server_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(BackendError, on_backend_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)

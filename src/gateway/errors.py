"""The one place where failures become HTTP statuses and OpenAI-shaped error bodies."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from backends.errors import (
    BackendError,
    BackendTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    SlowClientError,
    UnavailableError,
    UpstreamError,
)
from gateway.anthropic import errors as anthropic_errors
from gateway.openai.parameters import MissingParameter, ParameterError, UnsupportedParameter, shown

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
    if isinstance(exc, PayloadTooLargeError):
        return APIError(413, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, OverloadedError | UnavailableError):
        return APIError(503, exc.message, type="server_error", code=exc.code or "service_unavailable", headers=headers)
    if isinstance(exc, BackendTimeoutError):
        return APIError(504, exc.message, type="server_error", code=exc.code)
    if isinstance(exc, UpstreamError):
        return APIError(502, exc.message, type="server_error", code=exc.code or "upstream_error")
    return APIError(500, exc.message, type="server_error", code=exc.code)


def error_body(error: APIError, path: str, request_id: str | None = None) -> bytes:
    """The error's JSON body in the words of the API at ``path``: Anthropic's on the Messages routes, else
    OpenAI's."""
    if anthropic_errors.speaks_anthropic(path):
        return anthropic_errors.error_body(error.status, error.message, request_id)
    return orjson.dumps(error_payload(error.message, error.type, error.param, error.code))


SERVER_ERROR_MESSAGES = {
    500: "The server had an error processing your request.",
    502: "The model's server had an error processing your request.",
    503: "The model is not available right now; retry later.",
    504: "The request timed out.",
}
"""What a client reads of a server error: the detail (store errors, upstream URLs, backend names) is the operator's
and goes to the log."""


def public_error(error: APIError, request: Request | None) -> APIError:
    """``error`` as the client may see it (``shown_error``) for a request."""
    if request is None:
        return shown_error(error, None, None)
    return shown_error(error, getattr(request.state, "log", None), getattr(request.state, "request_id", None))


def shown_error(error: APIError, log: dict[str, Any] | None, request_id: str | None) -> APIError:
    """``error`` as the client may see it. A client mistake (4xx) is shown as it is; a server error (5xx) gets a
    generic message with the request id, and its detail goes into the request's access-log line (``log``)."""
    if error.status < 500:
        return error
    if log is not None:
        log["error_detail"] = error.message
    generic = SERVER_ERROR_MESSAGES.get(error.status, SERVER_ERROR_MESSAGES[500])
    message = f"{generic} (request id {request_id})" if request_id else generic
    return APIError(error.status, message, type=error.type, param=error.param, code=error.code, headers=error.headers)


def error_response(error: APIError, request: Request | None = None) -> Response:
    """The error as the API's JSON body (``error_body`` of ``public_error``); its code goes into the request's
    access-log line."""
    log = getattr(request.state, "log", None) if request is not None else None
    if log is not None:
        log["error_code"] = error.code or error.type
    request_id = getattr(request.state, "request_id", None) if request is not None else None
    error = shown_error(error, log, request_id)
    path = request.url.path if request is not None else ""
    body = error_body(error, path, request_id)
    return Response(body, status_code=error.status, media_type="application/json", headers=error.headers)


def model_not_found(model: str) -> ModelNotFoundError:
    """The 404 for a model nobody serves; the name is quoted cut short, so a huge name never makes a huge body."""
    return ModelNotFoundError(f"The model {shown(model)} does not exist or you do not have access to it.")


_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}
"""pydantic's type errors, in JSON's words."""
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):  # as OpenAI words it: 16.0 is an integer (JSON Schema), 16.5 a decimal number
        return "an integer" if value.is_integer() else "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "a value that is not JSON"


def _join(choices: list[str]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def _param_parts(
    loc: tuple[int | str, ...], body: object, *, missing: bool = False
) -> tuple[list[int | str], tuple[int | str, ...]]:
    """The parts of a pydantic error location that name keys and indexes of the request body, and the others:
    pydantic's union-branch labels (``str``, ``list[str]``, ``function-after[...]``), whatever the field names look
    like (``stream``, ``strawberry``), which together name the branch that failed."""
    parts: list[int | str] = []
    labels: list[int | str] = []
    node = body
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            parts.append(part)
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and (part in node or (missing and last)):
            parts.append(part)
            node = node.get(part)
        else:
            labels.append(part)
    return parts, tuple(labels)


def _dotted(parts: list[int | str]) -> str:
    """``messages[2].content[0].type``"""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _progress(parts: list[int | str]) -> tuple[int, tuple[int, ...]]:
    """How far into the body a union branch got before failing: deeper first, then further along its arrays."""
    return len(parts), tuple(p for p in parts if isinstance(p, int))


def _meant(
    errors: Sequence[Any], body: object
) -> tuple[list[int | str], dict[str, Any], list[tuple[list[int | str], dict[str, Any]]]]:
    """The error the client most likely meant, its path, and every error with its path. A union's branches each
    report their errors; the client meant the branch that got furthest into the body before its first failure, of
    those the one with the fewest failures (``[[1], null]`` is a list of prompts with one bad item, not a list of
    strings with two), and at that place a value out of range over a value of the wrong type (``[-1]`` is a token
    id below 0, not a string that is not one)."""
    located = []
    branches: dict[tuple[int | str, ...], list[tuple[list[int | str], dict[str, Any]]]] = {}
    for error in errors:
        loc = tuple(error.get("loc", ()))[1:]  # drop "body"
        parts, labels = _param_parts(loc, body, missing=error.get("type") == "missing")
        located.append((parts, error))
        branches.setdefault(labels, []).append((parts, error))

    def rank(branch: list[tuple[list[int | str], dict[str, Any]]]) -> tuple[tuple[int, tuple[int, ...]], int, bool]:
        first = min(_progress(parts) for parts, _ in branch)
        typed = any(_progress(p) == first and e.get("type") not in _EXPECTED for p, e in branch)
        return first, -len(branch), typed

    meant = max(branches.values(), key=rank)
    first = min(_progress(parts) for parts, _ in meant)
    at_first = [(parts, e) for parts, e in meant if _progress(parts) == first]
    parts, error = next(((p, e) for p, e in at_first if e.get("type") not in _EXPECTED), at_first[0])
    return parts, error, located


def _joined(base: str, where: str) -> str:
    if not where or where.startswith(("[", ".")):
        return base + where
    return f"{base}.{where}" if base else where


def validation_error(exc: RequestValidationError, content_type: str | None) -> APIError:
    """The most specific validation problem as OpenAI words it: a 400 with a ``param`` that is the full path,
    OpenAI's error ``code``, and no Python reprs (values are shown as JSON, cut short)."""
    body = getattr(exc, "body", None)
    errors = exc.errors()
    unreadable = _unreadable_body(errors, body, content_type)
    if unreadable is not None:
        return unreadable
    parts, error, located = _meant(errors, body)
    param = _dotted(parts)
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    value = error.get("input")
    problem = ctx.get("error")
    if isinstance(problem, ParameterError):
        return _parameter_error(problem, _joined(param, problem.where))
    name = param or "body"
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind in _EXPECTED:
        expected = list(
            dict.fromkeys(_EXPECTED[e["type"]] for p, e in located if p == parts and e["type"] in _EXPECTED)
        )
        message = f"Invalid type for '{name}': expected {_join(expected)}, but got {_json_type(value)} instead."
        return APIError(400, message, param=param or None, code="invalid_type")
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        which = "below_min" if kind.startswith("greater") else "above_max"
        number = "integer" if isinstance(value, int) else "decimal"
        message = f"Invalid '{name}': expected a value {_BOUNDS[kind]} {bound}, but got {shown(value)} instead."
        return APIError(400, message, param=param or None, code=f"{number}_{which}_value")
    if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        return _length_error(kind, name, param, value, ctx)
    if kind in ("literal_error", "enum"):
        message = f"Invalid value for '{name}': {shown(value)}. Supported values are: {ctx.get('expected')}."
        return APIError(400, message, param=param or None, code="invalid_value")
    reason = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"Invalid value for '{name}': {reason[:200]}", param=param or None, code="invalid_value")


def _unreadable_body(errors: Sequence[Any], body: Any, content_type: str | None) -> APIError | None:
    """The error of a body that is no JSON object to validate (no errors listed, bad JSON, another content type,
    empty), or None when validation looked at its fields."""
    if not errors:
        return APIError(400, "Invalid request body.", code="invalid_value")
    first = errors[0]
    if first.get("type", "") == "json_invalid":
        message = "We could not parse the JSON body of your request. The body must be valid JSON."
        return APIError(400, message, code="invalid_json")
    if isinstance(body, bytes | bytearray):  # FastAPI reads JSON only when the Content-Type says so
        message = (
            f"The request body must be JSON sent with 'Content-Type: application/json', not {shown(content_type)}."
        )
        return APIError(400, message, code="invalid_content_type")
    if body is None and first.get("loc") == ("body",):
        return APIError(400, "The request body is empty; send a JSON object.", code="missing_required_parameter")
    return None


def _parameter_error(problem: ParameterError, param: str) -> APIError:
    """A validator's own ``ParameterError``, at ``param`` (the field's path joined with the problem's)."""
    if isinstance(problem, MissingParameter):
        message = f"Missing required parameter: '{param}' ({problem.why})."
        return APIError(400, message, param=param, code=problem.code)
    verb = "Unsupported" if isinstance(problem, UnsupportedParameter) else "Invalid"
    return APIError(400, f"{verb} value for '{param}': {problem.why}", param=param or None, code=problem.code)


def _length_error(kind: str, name: str, param: str, value: Any, ctx: dict[str, Any]) -> APIError:
    """A string or array shorter or longer than its bounds, with OpenAI's ``empty_*`` code for an empty one."""
    what = "string" if kind.startswith("string") else "array"
    if kind.endswith("too_short"):
        code = f"empty_{what}" if not value else f"{what}_below_min_length"
        limit = f"at least {ctx.get('min_length')}"
    else:
        code, limit = f"{what}_above_max_length", f"at most {ctx.get('max_length')}"
    unit = "characters" if what == "string" else "items"
    return APIError(400, f"Invalid '{name}': expected {limit} {unit}.", param=param or None, code=code)


def internal_error(exc: Exception) -> APIError:
    """The 500 of an exception nothing expected (a bug); ``public_error`` keeps its detail from the client."""
    return APIError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error", code="internal_error")


def unexpected_error(exc: Exception, path: str, log: dict[str, Any] | None) -> APIError:
    """``internal_error``, for a request that had not started its response: logged with its traceback, its code in
    the request's access-log line."""
    logger.exception("unhandled error on %s", path, exc_info=exc)
    if log is not None:
        log["error_code"] = "internal_error"
    return internal_error(exc)


def install_error_handlers(app: FastAPI) -> None:
    """The handlers of every error a route raises on purpose; anything else is ``unexpected_error``'s, in
    ``gateway.middleware.InternalErrorMiddleware``."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc, request)

    async def on_backend_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BackendError)
        return error_response(api_error_from_backend(exc), request)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc, request.headers.get("content-type")), request)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        headers = dict(exc.headers or {})  # a 405 carries Allow
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # the router's: no route has this path
            message = f"Invalid URL ({request.method} {request.url.path})"
        return error_response(APIError(exc.status_code, message, type=kind, code=code, headers=headers), request)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # The client left while its body was read, or its body timed out (the connection guard answered 408):
        # no one reads this answer; gateway.middleware logs and counts the request as 499 or 408.
        return Response(status_code=499)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(BackendError, on_backend_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)

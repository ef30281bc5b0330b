"""The gateway's ASGI middleware: small pure ASGI classes, one job each, in the style of Starlette's own.

Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which costs about 3x on streaming paths. ``app.py``
installs them in this order, outermost first (``gateway_middleware``):

- ``RequestIdMiddleware``: names the request, opens its :class:`RequestRecord`, echoes the id on the response;
- ``AccessLogMiddleware``: one structured log line when the request ends, whatever its fate;
- ``TracingMiddleware``: the request's server span (with tracing on);
- ``RequestMetricsMiddleware``: counts the requests no backend took;
- ``IncompleteBodyMiddleware``: a body cut short is the client's doing (408 late, 499 gone), whatever the app said;
- ``DrainMiddleware``: refuses new generation requests while the gateway shuts down;
- ``BodyLimitMiddleware``: 413 for a body over its limit, by its ``Content-Length`` or as it arrives;
- ``InternalErrorMiddleware``: a bug's exception becomes a 500 the client can read, on a connection that stays open;
- then ``gateway.auth.ApiKeyMiddleware``, and the routes.

What one middleware learns of a request and another reports (its id, its status, its access-log fields) travels in
the request's :class:`RequestRecord`, in the ASGI scope's ``state`` under :data:`REQUEST_RECORD`: never a global.
Routes see the record's id and log fields as ``request.state.request_id`` and ``request.state.log``.

Streamed body frames may skip every ``send`` wrapper here (``gateway.connections.DirectBody``). That is safe only
while every middleware in the stack passes bodies through unchanged (``BODY_PRESERVING``): ``body_rewriters`` names
those of a stack that may not (Starlette's GZip, say), and ``WithoutDirectBody`` turns direct writes off for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import ApiKeyMiddleware
from gateway.connections import BODY_TIMEOUT, DIRECT_BODY
from gateway.errors import APIError, error_body, shown_error, unexpected_error
from gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.tracing import Tracing

_access_log = structlog.get_logger("gateway.access")
_REQUEST_ID = b"x-request-id"
_DRAINED_PREFIXES = ("/v1/", "/beta/")

REQUEST_RECORD = "gateway.request"
"""The key of the request's :class:`RequestRecord` in its ASGI scope's ``state``."""


@dataclass(slots=True)
class RequestRecord:
    """What the middleware learn about one request, for those that report it when it ends."""

    request_id: str
    started: float
    """``time.perf_counter()`` when the request reached the gateway."""
    log: dict[str, Any] = field(default_factory=dict)
    """The fields of its access-log line; routes add theirs (model, backend, tokens, an error code)."""
    status: int = 500
    """The status its response started with; 500 until one starts, or what ``IncompleteBodyMiddleware`` decided."""
    responding: bool = False
    """Whether its response has started (it can no longer be answered otherwise)."""

    @property
    def routed(self) -> bool:
        """Whether a backend took it: the route's metrics observer then counted it and wrote the backend's verdict
        as the log's ``status``."""
        return "status" in self.log

    @property
    def final_status(self) -> int:
        """The status its log line, its span and its metrics report: the backend's verdict when routed."""
        status: int = self.log.get("status", self.status)
        return status


def record_of(scope: Scope) -> RequestRecord:
    """The request's record (``RequestIdMiddleware``, the outermost, opened it)."""
    record: RequestRecord = scope["state"][REQUEST_RECORD]
    return record


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` so that FastAPI's body reader re-raises it untouched."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes.")


def _valid_request_id(raw: bytes) -> str | None:
    if 0 < len(raw) <= 128 and all(33 <= b < 127 for b in raw):
        return raw.decode("ascii")
    return None


def _client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == _REQUEST_ID:
            return _valid_request_id(value)
    return None


class _HttpMiddleware:
    """A pure ASGI middleware for HTTP requests: other scopes (lifespan) pass through; ``http`` does the job."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestIdMiddleware(_HttpMiddleware):
    """Names every HTTP request (the client's ``X-Request-ID`` when valid, else a new one) and echoes the name on
    its response; opens the request's :class:`RequestRecord` and notes in it the status its response starts with."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = _client_request_id(scope["headers"]) or os.urandom(16).hex()
        record = RequestRecord(request_id, time.perf_counter())
        state = scope.setdefault("state", {})
        state[REQUEST_RECORD] = record
        state["request_id"] = request_id
        state["log"] = record.log
        header = (_REQUEST_ID, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                record.responding = True
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class AccessLogMiddleware(_HttpMiddleware):
    """Writes one structured line per request once its response is complete (streams included), whatever its
    fate: its id, method, path, final status, the API key's label, its duration and what the routes logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = record_of(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            fields = record.log
            status = fields.pop("status", record.status)  # the last reader: the line says it once
            _access_log.info(
                "request",
                request_id=record.request_id,
                method=scope["method"],
                path=scope["path"],
                status=status,
                api_key=scope["state"].get("api_key"),
                duration_ms=round((time.perf_counter() - record.started) * 1000, 3),
                **fields,
            )


class TracingMiddleware(_HttpMiddleware):
    """The request's server span, current while the request runs (its other spans descend from it) and ended with
    what its log line says; its trace id goes into that line."""

    def __init__(self, app: ASGIApp, *, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = record_of(scope)
        span = self.tracing.start_request(scope, record.request_id)
        if span is None:  # a probe or a scrape
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if span.trace_id is not None:
                record.log["trace_id"] = span.trace_id
            route = getattr(scope.get("route"), "path", None)
            span.end(record.final_status, record.log, scope["state"].get("api_key"), route)


class RequestMetricsMiddleware(_HttpMiddleware):
    """Counts in ``gateway_requests_total`` every request no backend took (bad JSON, a validation 400, an unknown
    model, a 401, a 413, a 500), with empty model and backend labels; a routed request's observer counted it by
    model and backend."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = record_of(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            if not record.routed:
                self.metrics.count_unrouted(record.status, record.log.get("error_code"))


class IncompleteBodyMiddleware(_HttpMiddleware):
    """A request whose body never arrived whole ends as the client's doing, whatever the app made of the cut body:
    408 ``body_timeout`` when the connection guard's body deadline passed (it answered the client itself), 499
    ``client_disconnected`` when the client left while sending it. Routed requests keep their backend's verdict."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_done = False
        left_mid_body = False

        async def watched_receive() -> Message:
            nonlocal body_done, left_mid_body
            message = await receive()
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
            elif not body_done:
                left_mid_body = True
            return message

        try:
            await self.app(scope, watched_receive, send)
        finally:
            record = record_of(scope)
            if not record.routed:
                if scope["state"].get(BODY_TIMEOUT):
                    record.status = 408
                    record.log["error_code"] = BODY_TIMEOUT
                elif left_mid_body:
                    record.status = 499
                    record.log["error_code"] = "client_disconnected"


class DrainMiddleware:
    """While the gateway drains, refuses new generation requests (``POST`` under ``/v1/`` and ``/beta/``) with a
    503 ``draining`` and ``Retry-After``, so a load balancer's retry lands on another replica; the rest (probes,
    reads, requests under way) is served."""

    def __init__(self, app: ASGIApp, *, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.draining()
            and scope["method"] == "POST"
            and scope["path"].startswith(_DRAINED_PREFIXES)
        ):
            request_id = scope["state"]["request_id"]
            message = f"The gateway is shutting down. (request id {request_id})"
            await send_error(scope, send, APIError(503, message, type="server_error", code="draining"), retry_after=1)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware(_HttpMiddleware):
    """A body larger than ``max_body_bytes`` (or its path's own limit in ``larger_bodies``: the Batch API's file
    uploads) is a 413: at once when its ``Content-Length`` says so, else as soon as the bytes received pass it."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, larger_bodies: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.larger_bodies = dict(larger_bodies or {})

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.larger_bodies.get(scope["path"], self.max_body_bytes)
        declared = _content_length(scope["headers"])
        if declared is not None and declared > limit:
            message = str(BodyTooLargeError(limit).detail)
            await send_error(scope, send, APIError(413, message, code="request_too_large"))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class InternalErrorMiddleware(_HttpMiddleware):
    """An exception nothing expected (a bug, not the client's doing) is logged and answered with a 500 the client
    can read, on a connection that stays usable (an exception left to the server would close it after the answer).
    A response already under way cannot be answered: the exception goes on, and the server closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            record = record_of(scope)
            error = unexpected_error(exc, scope["path"], record.log)
            if record.responding:
                raise
            await send_error(scope, send, error)


async def send_error(scope: Scope, send: Send, error: APIError, retry_after: int | None = None) -> None:
    """Answers the request with ``error`` in the words of the API it called; its code goes into the request's log
    line and error count (a server error's detail goes to the log line, the client reads a generic message)."""
    record = record_of(scope)
    record.log["error_code"] = error.code or error.type
    shown = shown_error(error, record.log, record.request_id)
    body = error_body(shown, scope["path"], record.request_id)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


BODY_PRESERVING: frozenset[type] = frozenset(
    {
        RequestIdMiddleware,
        AccessLogMiddleware,
        TracingMiddleware,
        RequestMetricsMiddleware,
        IncompleteBodyMiddleware,
        DrainMiddleware,
        BodyLimitMiddleware,
        InternalErrorMiddleware,
        ApiKeyMiddleware,
        CORSMiddleware,
        TrustedHostMiddleware,
    }
)
"""Middleware known to pass response bodies through unchanged (they may add headers or answer on their own): with
only these in the stack, body frames may skip it (``DirectBody``)."""


def body_rewriters(middleware: Iterable[Middleware]) -> list[str]:
    """The names of the middleware in a stack not known to pass bodies through unchanged (``BODY_PRESERVING``)."""
    return [getattr(m.cls, "__name__", repr(m.cls)) for m in middleware if m.cls not in BODY_PRESERVING]


class WithoutDirectBody:
    """Runs an app with direct body writes off: each request's ``DirectBody`` is taken from its state before the
    app sees it, so every body frame goes through ASGI ``send`` and every middleware sees it (one that compresses or
    rewrites bodies would otherwise get the headers and none of the frames written past it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            state = scope.get("state")
            if state is not None:
                state.pop(DIRECT_BODY, None)
        await self.app(scope, receive, send)

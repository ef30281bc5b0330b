"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware costs about 3x on streams): request ids, body limit, logs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.connections import BODY_TIMEOUT
from gateway.errors import APIError, error_body, shown_error, unexpected_error
from gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.tracing import Tracing

_log = structlog.get_logger("gateway.access")
_REQUEST_ID = b"x-request-id"


def _valid_request_id(raw: bytes) -> str | None:
    if 0 < len(raw) <= 128 and all(33 <= b < 127 for b in raw):
        return raw.decode("ascii")
    return None


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` so that FastAPI's body reader re-raises it untouched."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes.")


class RequestContextMiddleware:
    """Gives every HTTP request an id (the client's ``X-Request-ID`` or a new one), enforces the body size limit,
    and writes one structured log line (with the API key's label when authentication is on) when the response is
    complete (streams included). Requests that never reached a backend are counted in ``gateway_requests_total``
    here, with empty model and backend labels. With tracing on, the request's server span covers the same time."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        access_log: bool = True,
        draining: Callable[[], bool] = lambda: False,
        metrics: GatewayMetrics | None = None,
        tracing: Tracing | None = None,
        larger_bodies: Mapping[str, int] | None = None,
    ) -> None:
        """``larger_bodies``: paths whose bodies may be larger than ``max_body_bytes``, and their own limits (the
        Batch API's file uploads)."""
        self.app = app
        self.larger_bodies = dict(larger_bodies or {})
        self.metrics = metrics
        self.tracing = tracing
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        content_length = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                request_id = _valid_request_id(value)
            elif name == b"content-length":
                content_length = int(value) if value.isdigit() else None
        request_id = request_id or os.urandom(16).hex()
        log: dict[str, Any] = {}
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["log"] = log
        started = time.perf_counter()
        status = 500
        header = (_REQUEST_ID, request_id.encode())
        span = self.tracing.start_request(scope, request_id) if self.tracing is not None else None

        responding = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, responding
            if message["type"] == "http.response.start":
                status = message["status"]
                responding = True
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        limit = self.larger_bodies.get(scope["path"], self.max_body_bytes)
        left_mid_body = False
        try:
            if self.draining() and scope["path"].startswith(("/v1/", "/beta/")) and scope["method"] == "POST":
                await _send_error(
                    scope,
                    send_with_id,
                    APIError(
                        503,
                        f"The gateway is shutting down. (request id {request_id})",
                        type="server_error",
                        code="draining",
                    ),
                    retry_after=1,
                )
                return
            if content_length is not None and content_length > limit:
                too_large = BodyTooLargeError(limit)
                await _send_error(scope, send_with_id, APIError(413, str(too_large.detail), code="request_too_large"))
                return
            received = 0
            body_done = False

            async def limited_receive() -> Message:
                nonlocal received, body_done, left_mid_body
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLargeError(limit)
                    body_done = not message.get("more_body", False)
                elif not body_done:  # the client left while sending its body: not a bad body, a client gone
                    left_mid_body = True
                return message

            try:
                await self.app(scope, limited_receive, send_with_id)
            except Exception as exc:
                # A bug, not the client's doing: logged, and answered here as a 500 the client can read, on a
                # connection that stays usable (an exception left to the server would close it after the answer).
                # A response already under way cannot be answered: the server closes its connection.
                error = unexpected_error(exc, scope["path"], log)
                if responding:
                    raise
                await _send_error(scope, send_with_id, error)
        finally:
            # A request that reached a backend was counted by its observer (which set the status, the
            # backend's verdict); any other (bad JSON, validation 400, unknown model, 401, 413, 500) is counted here.
            routed = "status" in log
            final_status = log.pop("status", status)
            if state.get(BODY_TIMEOUT) and not routed:  # the connection guard answered 408 for the late body
                final_status = 408
                log["error_code"] = BODY_TIMEOUT
            elif left_mid_body and not routed:  # whatever the app made of the cut body, the client is gone
                final_status = 499
                log["error_code"] = "client_disconnected"
            if self.metrics is not None and not routed:
                self.metrics.count_unrouted(final_status, log.get("error_code"))
            if span is not None:
                trace_id = span.trace_id
                if trace_id is not None:
                    log["trace_id"] = trace_id
                route = scope.get("route")
                span.end(final_status, log, state.get("api_key"), getattr(route, "path", None))
            if self.access_log:
                _log.info(
                    "request",
                    request_id=request_id,
                    method=scope["method"],
                    path=scope["path"],
                    status=final_status,
                    api_key=state.get("api_key"),
                    duration_ms=round((time.perf_counter() - started) * 1000, 3),
                    **log,
                )


async def _send_error(scope: Scope, send: Send, error: APIError, retry_after: int | None = None) -> None:
    state = scope["state"]
    request_id = state.get("request_id")
    body = error_body(shown_error(error, state.get("log"), request_id), scope["path"], request_id)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

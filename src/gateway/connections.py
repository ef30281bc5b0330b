"""Connection limits uvicorn lacks: a deadline for a request's headers, a cap on their size, a bound on connections.

uvicorn's httptools protocol waits forever for a request's headers (3,000 connections sending one byte per second
were all kept open), buffers headers of any size, and accepts every connection the kernel hands it
(``limit_concurrency`` only answers 503 once headers are complete, so it cannot stop a slowloris). This module
subclasses that protocol:

- ``header_timeout``: from the moment a connection opens, or the first byte of the next request on a keep-alive
  connection, the client has this long to complete its headers; then it gets a 408 and the connection is closed.
  Sending more bytes does not extend the deadline. (Idle time between requests is uvicorn's keep-alive timeout.)
- ``max_header_bytes``: a request line plus headers larger than this gets a 431 and the connection is closed.
- ``max_connections``: a connection past this many open ones gets a 503 and is closed at once.
- ``body_timeout``: from the end of a request's headers, the client has this long to send its whole body. Past it,
  a request the app has not answered yet gets a 408 (OpenAI-shaped, with its request id; the app sees the client
  gone and its log line says 408 ``body_timeout``), and the connection is closed either way (a body still
  trickling in after an early answer, a 401 say, would hold it too).

A listener may serve only some paths (``paths``): the probe listener (``server.http.probe_port``) answers ``/health``,
``/ready`` and ``/metrics`` with a cap of its own, so clients that fill the API listener's ``max_connections``
never starve the kubelet's probes; any other path gets a 404 and a close.

A streamed response's body frames may skip the ASGI send chain (``DIRECT_BODY``): the request's state carries a
:class:`DirectBody` that writes a chunk straight to the connection while nothing stands in the way (the response
started with chunked encoding, the socket takes bytes, the client is there); otherwise the caller sends through
ASGI as usual, whose send waits for a full socket to drain. An app whose middleware may rewrite bodies takes the
``DirectBody`` out of each request's state (``gateway.middleware.WithoutDirectBody``), so that they see every frame.

Every closed connection is counted in ``gateway_connections_closed_total{listener,reason}``; open ones in
``gateway_connections_open{listener}``. Timers run on an injected ``Clock`` (the event loop by default).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, Protocol

import httptools
from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.errors import APIError, error_body

HEADER_TIMEOUT = "header_timeout"
HEADER_TOO_LARGE = "header_too_large"
TOO_MANY_CONNECTIONS = "too_many_connections"
BODY_TIMEOUT = "body_timeout"
"""Also the key set in the request's ASGI state when its body timed out, and its error code."""
NOT_A_PROBE_PATH = "not_a_probe_path"
BAD_REQUEST = "bad_request"
"""A request the HTTP parser refused (a bare LF in a header, a malformed request line): a 400, and a close."""
DIRECT_BODY = "gateway.direct_body"
"""The key of the request's :class:`DirectBody` in its ASGI scope's ``state`` (absent under other servers, and
under a middleware that may rewrite bodies)."""
REASONS = (HEADER_TIMEOUT, HEADER_TOO_LARGE, TOO_MANY_CONNECTIONS, BODY_TIMEOUT, NOT_A_PROBE_PATH, BAD_REQUEST)

API_LISTENER = "api"
PROBE_LISTENER = "probe"
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
PROBE_MAX_CONNECTIONS = 64
"""The probe listener's own cap: kubelet probes open one short connection each, Prometheus keeps one alive."""

LINGER_SECONDS = 1.0
"""After answering 408 or 431, how long the rest of the client's bytes are read and dropped before the close (a
close with unread input sends a TCP reset, which can destroy the answer before the client reads it)."""


def _error_response(status: int, message: str, code: str, path: str = "", request_id: str | None = None) -> bytes:
    """A whole HTTP response that closes the connection, with the error JSON of the API at ``path`` (Anthropic's on
    the Messages routes, else OpenAI's), as every answer of the gateway's is: the server writes these before any
    request reaches the app."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = error_body(APIError(status, message, type=kind, code=code), path, request_id)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n" % (
        status,
        HTTPStatus(status).phrase.encode(),
    )
    if request_id is not None:
        head += b"x-request-id: " + request_id.encode() + b"\r\n"
    return head + b"content-length: %d\r\n\r\n%b" % (len(body), body)


def _path_of(url: bytes) -> str:
    """The path of a request target as far as it was received, or "" when it cannot be parsed (yet)."""
    try:
        return httptools.parse_url(url).path.decode("latin-1") if url else ""
    except httptools.HttpParserInvalidURLError:
        return ""


_BUSY_RESPONSE = _error_response(503, "Too many open connections; retry later.", TOO_MANY_CONNECTIONS)
_NOT_A_PROBE_RESPONSE = _error_response(404, "The probe port serves only /health, /ready and /metrics.", "not_found")


class DirectBody:
    """Writes one request's response body chunks straight to its connection (see the module docstring).

    ``write(chunk)`` is what uvicorn's ``send`` of ``{"type": "http.response.body", "body": chunk, "more_body":
    True}`` does when it would not wait, without the ASGI middleware's send wrappers above it (each a coroutine per
    frame: Starlette's error and exception handlers, the gateway's middleware). It returns False, having
    written nothing, whenever that send would do anything else (wait for a full socket, drop the chunk of a client
    that left, refuse a body before the start or after the end, write a HEAD or a sized response): the caller then
    sends the message through ASGI. Only the status line and headers, which the middleware does see, come first."""

    __slots__ = ("_cycle", "_head")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        # Held weakly: the cycle's scope holds this object, so a strong reference would make every request a
        # reference cycle, whose objects only the cycle collector frees.
        self._cycle = weakref.ref(cycle)
        self._head = cycle.scope["method"] == "HEAD"

    def write(self, chunk: bytes) -> bool:
        cycle = self._cycle()
        if (
            cycle is None  # the request is over
            or not cycle.chunked_encoding  # also None: the response has not started
            or cycle.response_complete
            or cycle.disconnected
            or cycle.flow.write_paused
            or self._head
            or not chunk
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    def abandon(self) -> None:
        """Drops the connection of a response that cannot complete because its client stopped reading: at once,
        with what its full send buffer still holds, and as a client gone (uvicorn would otherwise report the
        incomplete response as an error of the app's, and close only once that buffer drained)."""
        cycle = self._cycle()
        if cycle is not None:
            cycle.disconnected = True
            cycle.transport.abort()


class Timer(Protocol):
    """A pending callback (``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time and timers; ``asyncio.AbstractEventLoop`` is one."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float | None = 10.0
    body_timeout: float | None = 30.0
    max_header_bytes: int = 64 * 1024
    max_connections: int | None = 2048


class ConnectionMetrics:
    """The connection counters of one server, by listener."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.closed = Counter(
            "gateway_connections_closed",
            "Connections the gateway closed for breaking a connection limit, by listener and reason.",
            ("listener", "reason"),
            registry=registry,
        )
        self.open = Gauge("gateway_connections_open", "Open HTTP connections.", ("listener",), registry=registry)


class ConnectionGuard:
    """The limits and open connections of one listener (``paths``: the only paths it serves; None: all)."""

    def __init__(
        self,
        limits: ConnectionLimits,
        metrics: ConnectionMetrics,
        *,
        listener: str = API_LISTENER,
        paths: frozenset[str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.limits = limits
        self.listener = listener
        self.paths = paths
        self.clock = clock
        """None: each connection's event loop."""
        self.open = 0
        self._closed = {reason: metrics.closed.labels(listener, reason) for reason in REASONS}
        metrics.open.labels(listener).set_function(lambda: self.open)

    def closed(self, reason: str) -> None:
        self._closed[reason].inc()

    def protocol(self) -> type[asyncio.Protocol]:
        """The protocol class to give uvicorn (``Config(http=...)``), bound to this guard."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": self})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of its ``guard``."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock: Clock = self.guard.clock or self.loop
        self._refused = False
        self._counted = False
        self._header_timer: Timer | None = None
        self._body_timer: Timer | None = None
        self._header_bytes: int | None = 0  # bytes of the current request's head so far; None while not in a head
        self._closing: asyncio.TimerHandle | None = None  # set while lingering before the close
        self._rejected: tuple[bytes, str] | None = None  # a head refused without a request cycle: answer, reason
        self._awaiting_body = False  # headers in, body not yet complete
        self.url = b""  # uvicorn sets it at a request's first byte; an answer before that has no path

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self.guard
        limit = guard.limits.max_connections
        if limit is not None and guard.open >= limit:
            self._refused = True
            self.transport = transport
            transport.write(_BUSY_RESPONSE)
            transport.close()
            guard.closed(TOO_MANY_CONNECTIONS)
            return
        guard.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        if self._closing is not None:
            self._closing.cancel()
        if self._counted:
            self._counted = False
            self.guard.open -= 1
        if self._refused:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._closing is not None:
            return  # refused, or answered and lingering: the rest is dropped
        if self._header_bytes is not None:
            self._header_bytes += len(data)  # may include the start of the body; only checked while in the head
        super().data_received(data)
        if self._rejected is not None:
            self._close(*self._rejected)
        elif self._header_bytes is not None and self._header_bytes > self.guard.limits.max_header_bytes:
            self._close(self._too_large(), HEADER_TOO_LARGE)
        elif self._awaiting_body and self._body_timer is None:
            # Armed only now, once the bytes that completed the headers are parsed: a request without a body, or
            # whose body came with its headers, never sets a timer.
            self._arm_body_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._header_bytes = None
        head = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        paths = self.guard.paths
        # A refused head starts no request cycle; data_received answers and closes once the parse returns.
        if head > self.guard.limits.max_header_bytes:
            self._rejected = (self._too_large(), HEADER_TOO_LARGE)
            return
        if paths is not None and httptools.parse_url(self.url).path.decode("latin-1") not in paths:
            self._rejected = (_NOT_A_PROBE_RESPONSE, NOT_A_PROBE_PATH)
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # a request cycle was started (not an upgrade)
            self.scope["state"][DIRECT_BODY] = DirectBody(cycle)
        self._awaiting_body = not (self.parser.should_upgrade() and self._should_upgrade())  # an upgrade has no body

    def on_body(self, body: bytes) -> None:
        if self._rejected is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        # The next bytes are the next request's head. Not before: an app may answer (a 413, a 401) while the body
        # still arrives, and those bytes are no head.
        self._header_bytes = 0
        self._awaiting_body = False
        self._disarm_body_timer()
        if self._rejected is None:
            super().on_message_complete()

    def _arm_header_timer(self) -> None:
        timeout = self.guard.limits.header_timeout
        if timeout is not None:
            self._header_timer = self._clock.call_at(self._clock.time() + timeout, self._on_header_timeout)

    def _arm_body_timer(self) -> None:
        timeout = self.guard.limits.body_timeout
        if timeout is not None:
            self._body_timer = self._clock.call_at(self._clock.time() + timeout, self._on_body_timeout)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_body_timeout(self) -> None:
        """The body is late: answer 408 for an app still waiting for it (which then sees the client gone), and
        close the connection either way."""
        self._body_timer = None
        cycle = self.cycle
        response = b""
        if cycle is not None and not cycle.response_started and not cycle.disconnected:
            state = cycle.scope["state"]
            state[BODY_TIMEOUT] = True  # the request's log line and metrics say 408 (gateway.middleware)
            cycle.disconnected = True  # receive() returns http.disconnect; whatever the app sends is dropped
            cycle.message_event.set()
            message = f"The request body was not received within {self.guard.limits.body_timeout:g} s."
            response = _error_response(408, message, BODY_TIMEOUT, cycle.scope["path"], state.get("request_id"))
        self._close(response, BODY_TIMEOUT)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        message = "The request headers were not received in time."
        response = _error_response(408, message, HEADER_TIMEOUT, self._path()) if self._header_bytes else b""
        self._close(response, HEADER_TIMEOUT)

    def _path(self) -> str:
        """The path of the request being received, as far as it is known (none before its first byte)."""
        return _path_of(self.url)

    def _too_large(self) -> bytes:
        message = f"The request line and headers are larger than {self.guard.limits.max_header_bytes} bytes."
        return _error_response(431, message, HEADER_TOO_LARGE, self._path())

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses, as the API's error JSON instead of its plain text."""
        message = "The request is not valid HTTP/1.1 (a malformed request line or header)."
        self._close(_error_response(400, message, BAD_REQUEST, self._path()), BAD_REQUEST)

    def _close(self, response: bytes, reason: str) -> None:
        """Answer (if ``response``), then close: at once, or after a linger that drains the client's input."""
        self._disarm_header_timer()
        self._disarm_body_timer()
        transport = self.transport
        if transport.is_closing() or self._closing is not None:
            return
        self.guard.closed(reason)
        if response and transport.can_write_eof():
            transport.write(response)
            transport.write_eof()  # the answer, then FIN; the client's close (or the linger's end) closes
            self._closing = self.loop.call_later(LINGER_SECONDS, transport.close)
            return
        if response:
            transport.write(response)
        transport.close()

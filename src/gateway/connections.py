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

Every closed connection is counted in ``gateway_connections_closed_total{reason}``; open ones in
``gateway_connections_open``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT = "header_timeout"
HEADER_TOO_LARGE = "header_too_large"
TOO_MANY_CONNECTIONS = "too_many_connections"

LINGER_SECONDS = 1.0
"""After answering 408 or 431, how long the rest of the client's bytes are read and dropped before the close (a
close with unread input sends a TCP reset, which can destroy the answer before the client reads it)."""


def _response(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        b"content-length: " + str(len(message)).encode() + b"\r\n\r\n" + message
    )


_TIMEOUT_RESPONSE = _response(b"408 Request Timeout", b"The request headers were not received in time.")
_TOO_LARGE_RESPONSE = _response(b"431 Request Header Fields Too Large", b"The request headers are too large.")
_BUSY_RESPONSE = _response(b"503 Service Unavailable", b"Too many open connections.")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float | None = 10.0
    max_header_bytes: int = 64 * 1024
    max_connections: int | None = 2048


class ConnectionGuard:
    """The limits and counters shared by all connections of one server."""

    def __init__(self, limits: ConnectionLimits, registry: CollectorRegistry | None = None) -> None:
        self.limits = limits
        self.open = 0
        self._closed = Counter(
            "gateway_connections_closed",
            "Connections the gateway closed for breaking a connection limit, by reason.",
            ("reason",),
            registry=registry,
        )
        for reason in (HEADER_TIMEOUT, HEADER_TOO_LARGE, TOO_MANY_CONNECTIONS):
            self._closed.labels(reason)
        Gauge("gateway_connections_open", "Open HTTP connections.", registry=registry).set_function(lambda: self.open)

    def closed(self, reason: str) -> None:
        self._closed.labels(reason).inc()

    def protocol(self) -> type[asyncio.Protocol]:
        """The protocol class to give uvicorn (``Config(http=...)``), bound to this guard."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": self})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of its ``guard``."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes: int | None = 0  # bytes of the current request's head so far; None while not in a head
        self._closing: asyncio.TimerHandle | None = None  # set while lingering before the close
        self._head_too_large = False

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
        if self._head_too_large or (
            self._header_bytes is not None and self._header_bytes > self.guard.limits.max_header_bytes
        ):
            self._close(_TOO_LARGE_RESPONSE, HEADER_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._header_bytes = None
        head = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if head > self.guard.limits.max_header_bytes:
            self._head_too_large = True  # no request cycle starts; data_received answers 431 after the parse
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._head_too_large:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._head_too_large:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        self._header_bytes = 0  # the next bytes are the next request's head (uvicorn's keep-alive timer runs now)
        super().on_response_complete()

    def _arm_header_timer(self) -> None:
        timeout = self.guard.limits.header_timeout
        if timeout is not None:
            self._header_timer = self.loop.call_later(timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        self._close(_TIMEOUT_RESPONSE if self._header_bytes else b"", HEADER_TIMEOUT)

    def _close(self, response: bytes, reason: str) -> None:
        """Answer (if ``response``), then close: at once, or after a linger that drains the client's input."""
        self._disarm_header_timer()
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

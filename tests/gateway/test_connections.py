"""Connection limits on the real server (uvicorn, uvloop, httptools as ``serve`` runs them), over raw sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.connections import ConnectionGuard
from gateway.server import connection_guard, uvicorn_config

from ..conftest import MODEL, wait_until

SAFETY_SECONDS = 20.0
"""How long a client waits for the server to act before the test fails (never reached when the limit works)."""


@dataclass
class Served:
    host: str
    port: int
    guard: ConnectionGuard
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=SAFETY_SECONDS)
        sock.settimeout(SAFETY_SECONDS)
        return sock


def serve(settings: GatewayConfig) -> Served:
    app = create_app(settings)
    guard = connection_guard(settings.server, app)
    server = uvicorn.Server(uvicorn_config(settings, app, guard))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    served = Served("127.0.0.1", port, guard, server, thread)

    def ready() -> bool:
        try:
            return httpx.get(f"{served.base_url}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    assert wait_until(ready, timeout=180), "the gateway did not become ready"
    return served


def shut(served: Served) -> None:
    served.server.should_exit = True
    served.thread.join(timeout=30)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def settings(**server: object) -> GatewayConfig:
    return GatewayConfig(
        server={"access_log": False, **server},
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )


@pytest.fixture(scope="module")
def strict() -> Iterator[Served]:
    """A gateway that gives clients half a second for their headers."""
    served = serve(settings(header_timeout=0.5))
    yield served
    shut(served)


def closed_for(served: Served, reason: str) -> float:
    metrics = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    line = next(
        line
        for line in metrics.splitlines()
        if line.startswith(f'gateway_connections_closed_total{{reason="{reason}"}}')
    )
    return float(line.rsplit(" ", 1)[1])


def test_headers_sent_one_byte_at_a_time_are_cut_off_at_the_header_timeout(strict: Served) -> None:
    before = closed_for(strict, "header_timeout")
    head = b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Slow: " + b"a" * 100_000
    stop = threading.Event()
    sent = [0]

    def trickle(sock: socket.socket) -> None:
        """A slowloris client: one byte of headers every 10 ms, for as long as the server listens."""
        try:
            for byte in head:
                if stop.is_set():
                    return
                sock.send(bytes((byte,)))
                sent[0] += 1
                time.sleep(0.01)  # the client's pace, not synchronization: the test waits on the close below
        except OSError:
            return  # the server closed the connection

    with strict.connect() as sock:
        sender = threading.Thread(target=trickle, args=(sock,))
        sender.start()
        try:
            answer = read_until_closed(sock)
        finally:
            stop.set()
            sender.join()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert sent[0] < len(head), "the connection was closed while the headers were still arriving"
    assert closed_for(strict, "header_timeout") == before + 1


def test_a_connection_that_never_sends_a_byte_is_closed_at_the_header_timeout(strict: Served) -> None:
    with strict.connect() as sock:
        assert read_until_closed(sock) == b""


def test_requests_slower_than_the_header_timeout_are_not_cut_once_their_headers_are_in(strict: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 100, "ignore_eos": True}
    with httpx.Client(base_url=strict.base_url, timeout=SAFETY_SECONDS) as http:
        for _ in range(2):  # the second request reuses the kept-alive connection: its headers get a new deadline
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 100  # 100 steps of 10 ms: over header_timeout


@pytest.mark.parametrize("complete", [True, False], ids=["whole-head", "head-never-ends"])
def test_oversized_headers_get_431_and_the_connection_is_closed(strict: Served, complete: bool) -> None:
    before = closed_for(strict, "header_too_large")
    head = b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * 70_000
    with strict.connect() as sock:
        sock.sendall(head + b"\r\n\r\n" if complete else head)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert closed_for(strict, "header_too_large") == before + 1


def test_a_body_much_larger_than_max_header_bytes_is_not_mistaken_for_headers(strict: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 1}
    response = httpx.post(f"{strict.base_url}/v1/chat/completions", json=body, timeout=SAFETY_SECONDS)
    assert response.status_code == 400  # read whole, then refused for the context, not for its headers
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_connections_past_max_connections_get_503_until_one_closes() -> None:
    served = serve(settings(max_connections=2, header_timeout=None))
    try:
        idle = [served.connect(), served.connect()]
        assert wait_until(lambda: served.guard.open == 2)
        with served.connect() as extra:
            assert read_until_closed(extra).startswith(b"HTTP/1.1 503 ")
        idle.pop().close()
        assert wait_until(lambda: served.guard.open == 1)
        response = httpx.get(f"{served.base_url}/metrics", timeout=10)
        assert response.status_code == 200
        assert 'gateway_connections_closed_total{reason="too_many_connections"} 1.0' in response.text
        idle.pop().close()
    finally:
        shut(served)

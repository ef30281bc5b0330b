"""Connection limits on the real server (uvicorn, uvloop, httptools as ``serve`` runs them), over raw sockets."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.connections import Clock, ConnectionGuard
from gateway.server import bind, gateway_server

from ..conftest import MODEL, server_sections, wait_until
from ..waiting import wait_ready

SAFETY_SECONDS = 20.0
"""How long a client waits for the server to act before the test fails (never reached when the limit works)."""


@dataclass
class Served:
    host: str
    port: int
    guard: ConnectionGuard
    server: uvicorn.Server
    thread: threading.Thread
    probe_port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def probe_url(self) -> str:
        return f"http://{self.host}:{self.probe_port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=SAFETY_SECONDS)
        sock.settimeout(SAFETY_SECONDS)
        return sock


def serve(settings: GatewayConfig, *, probe: bool = False, clock: Clock | None = None) -> Served:
    """The gateway as ``serve`` runs it (``gateway_server``), on loopback ports the kernel picks; ``probe``: with the
    probe listener."""
    app = create_app(settings)
    sock = bind("127.0.0.1", 0)
    probe_socket = bind("127.0.0.1", 0) if probe else None
    server = gateway_server(settings, app, probe_socket=probe_socket, clock=clock)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    probe_port = probe_socket.getsockname()[1] if probe_socket is not None else None
    served = Served("127.0.0.1", port, server.guard, server, thread, probe_port)

    assert wait_ready(f"{served.probe_url if probe else served.base_url}/ready"), "the gateway did not become ready"
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
        server=server_sections(access_log=False, **server),
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )


@pytest.fixture(scope="module")
def strict() -> Iterator[Served]:
    """A gateway that gives clients half a second for their headers and a second for their body."""
    served = serve(settings(header_timeout=0.5, body_timeout=1.0))
    yield served
    shut(served)


def metric(served: Served, sample: str, **labels: str) -> float:
    """The sum of ``/metrics`` samples named ``sample`` whose labels include ``labels``."""
    url = served.probe_url if served.probe_port is not None else served.base_url
    return sum(
        found.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
        for found in family.samples
        if found.name == sample and all(found.labels.get(k) == v for k, v in labels.items())
    )


def closed_for(served: Served, reason: str, listener: str = "api") -> float:
    return metric(served, "gateway_connections_closed_total", listener=listener, reason=reason)


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


def test_a_body_that_arrives_after_its_early_answer_is_not_mistaken_for_the_next_head(strict: Served) -> None:
    """The app answers a 413 from the Content-Length before reading the body; the body the client sends after that
    answer (larger than max_header_bytes) is still that request's, and the next request on the connection is served.
    """
    limit = strict.server.config.app.state.gateway.config.server.http.max_body_bytes
    size = limit + 1
    with strict.connect() as sock:
        reader = sock.makefile("rb")
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {size}\r\n\r\n".encode()
        )
        assert reader.readline().startswith(b"HTTP/1.1 413 ")  # answered before a byte of the body was sent
        headers = read_head(reader)
        reader.read(int(headers["content-length"]))
        if headers.get("connection") == "close":
            return  # the server may close instead; then nothing can be mistaken
        sock.sendall(b"x" * size)  # the rest of the request: its body, far over max_header_bytes
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
        assert reader.readline().startswith(b"HTTP/1.1 200 "), "the body was read as the next request's head"


def read_head(reader: Any) -> dict[str, str]:
    """The headers of a response whose status line was read, from a kept-alive connection's reader."""
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    return headers


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
        assert 'gateway_connections_closed_total{listener="api",reason="too_many_connections"} 1.0' in response.text
        idle.pop().close()
    finally:
        shut(served)


# --- slow bodies and the probe listener ------------------------------------------------------------------------------


class ManualClock:
    """TEST DOUBLE of the connection guard's ``Clock``: the event loop's time, but a timer runs only when the test
    calls ``fire``, so a test can look at connections held past their deadline without racing it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.AbstractEventLoop, asyncio.Handle]] = []

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.Handle:
        loop = asyncio.get_running_loop()
        handle = asyncio.Handle(callback, (), loop)
        with self._lock:
            self._pending.append((loop, handle))
        return handle

    def fire(self) -> None:
        """Runs every timer set so far (on its loop) that was not cancelled."""
        with self._lock:
            pending, self._pending = self._pending, []
        for loop, handle in pending:
            loop.call_soon_threadsafe(lambda h=handle: None if h.cancelled() else h._run())


def slow_body(served: Served, path: str = "/v1/chat/completions", request_id: str = "slow") -> socket.socket:
    """A client that sends complete headers announcing 2000 body bytes, waits until the app asks for the body
    (``100 Continue``: the server has the headers and waits for the body), then sends one byte and stalls."""
    sock = served.connect()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: 2000\r\n"
        f"Expect: 100-continue\r\nX-Request-ID: {request_id}\r\n\r\n".encode()
    )
    assert sock.recv(1024).startswith(b"HTTP/1.1 100 "), "the app did not start reading the body"
    sock.sendall(b"{")
    return sock


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_a_body_slower_than_the_body_timeout_gets_a_408_with_its_request_id_and_is_counted(
    strict: Served, caplog: pytest.LogCaptureFixture
) -> None:
    closed = closed_for(strict, "body_timeout")
    unrouted = metric(strict, "gateway_requests_total", model="", backend="", status="408")
    with slow_body(strict, request_id="late-body-1") as sock:
        status, headers, body = parse_response(read_until_closed(sock))
    assert status == 408
    assert headers["x-request-id"] == "late-body-1" and headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert error["code"] == "body_timeout" and error["type"] == "invalid_request_error"
    assert closed_for(strict, "body_timeout") == closed + 1
    assert wait_until(
        lambda: metric(strict, "gateway_requests_total", model="", backend="", status="408") == unrouted + 1
    ), "the request is counted (and logged) as the 408 it got, not as a client that left"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, f"a late body is the client's doing, not a server error: {errors}"


def test_a_body_still_trickling_in_after_an_early_answer_is_cut_at_the_body_timeout(strict: Served) -> None:
    """Starlette answers an unknown path without reading the body; the connection would wait for the rest."""
    closed = closed_for(strict, "body_timeout")
    with strict.connect() as sock:
        sock.sendall(b"POST /no-such-path HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2000\r\n\r\n{")
        status, _, _ = parse_response(read_until_closed(sock))
    assert status == 404
    assert closed_for(strict, "body_timeout") == closed + 1


@pytest.fixture(scope="module")
def capped() -> Iterator[tuple[Served, ManualClock]]:
    """Room for three API connections, a probe listener, and connection timers that run when the test says."""
    clock = ManualClock()
    served = serve(settings(max_connections=3, body_timeout=1.0), probe=True, clock=clock)
    yield served, clock
    clock.fire()
    shut(served)


def test_slow_bodies_past_the_connection_cap_do_not_starve_probes_and_each_gets_its_408(
    capped: tuple[Served, ManualClock],
) -> None:
    served, clock = capped
    slow = [slow_body(served, request_id=f"slow-{i}") for i in range(3)]
    try:
        assert served.guard.open == 3
        for _ in range(2):  # clients past the cap are refused at once
            with served.connect() as extra:
                assert read_until_closed(extra).startswith(b"HTTP/1.1 503 ")
        assert httpx.get(f"{served.probe_url}/health", timeout=SAFETY_SECONDS).status_code == 200
        ready = httpx.get(f"{served.probe_url}/ready", timeout=SAFETY_SECONDS)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert served.guard.open == 3, "premise: the API listener was full all along"
        clock.fire()  # every body deadline passes
        for i, sock in enumerate(slow):
            status, headers, body = parse_response(read_until_closed(sock))
            assert status == 408 and headers["x-request-id"] == f"slow-{i}"
            assert orjson.loads(body)["error"]["code"] == "body_timeout"
    finally:
        for sock in slow:
            sock.close()
    assert wait_until(lambda: served.guard.open == 0)
    assert httpx.get(f"{served.base_url}/health", timeout=SAFETY_SECONDS).status_code == 200
    assert closed_for(served, "too_many_connections") == 2
    assert closed_for(served, "body_timeout") == 3


def test_the_probe_listener_serves_only_probe_paths(capped: tuple[Served, ManualClock]) -> None:
    served, _ = capped
    before = closed_for(served, "not_a_probe_path", listener="probe")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = httpx.post(f"{served.probe_url}/v1/chat/completions", json=body, timeout=SAFETY_SECONDS)
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "not_found"
    assert closed_for(served, "not_a_probe_path", listener="probe") == before + 1
    metrics = httpx.get(f"{served.probe_url}/metrics", timeout=SAFETY_SECONDS)
    assert metrics.status_code == 200 and "gateway_connections_open" in metrics.text

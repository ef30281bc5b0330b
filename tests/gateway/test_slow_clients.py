"""A client that does not read its stream cannot make the gateway hold unbounded output for it: past
``server.streams.stream_buffer_tokens`` waiting tokens, or ``server.streams.stall_timeout`` seconds without taking
data, its engine request is aborted, its stream closed, and the stall counted."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator

import orjson
import pytest

from gateway.config import GatewayConfig

from ..conftest import MODEL, TIMED_STEP, RunningGateway, server_sections, start_gateway, stop_gateway, wait_until

# Big frames (20 alternatives per token, 4 choices) fill the socket buffers after a few dozen steps.
HEAVY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go on"}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "n": 4,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
}
MAX_TOKENS_ALL_CHOICES = 4 * 4000


def _gateway(**server: object) -> RunningGateway:
    config = GatewayConfig(
        server=server_sections(**server),
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": TIMED_STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    return start_gateway(config)


def _non_reading_client(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, set before connecting
    sock.connect((host, int(port)))
    payload = orjson.dumps(HEAVY)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _stalls(gateway: RunningGateway, reason: str) -> float:
    return gateway.metric("gateway_stream_stalls_total", reason=reason)


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    """Reads until ``marker`` has arrived or the server closed the connection."""
    sock.settimeout(30)
    data = b""
    while marker not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture(scope="module")
def small_buffer() -> Iterator[RunningGateway]:
    running = _gateway(stream_buffer_tokens=64, stall_timeout=None)
    yield running
    stop_gateway(running)


def test_a_reader_that_falls_too_far_behind_is_stopped_and_told_why(small_buffer: RunningGateway) -> None:
    before = small_buffer.engine_tokens()
    sock = _non_reading_client(small_buffer.base_url)
    try:
        # The engine work stops while the client still reads nothing (4 x 4,000 tokens without the bound).
        assert wait_until(lambda: small_buffer.engine_tokens() > before)
        assert wait_until(small_buffer.engine_idle, timeout=30)
        assert small_buffer.engine_tokens() - before < MAX_TOKENS_ALL_CHOICES / 4
        # The client reads again: what was sent before the stop, then the error frame and [DONE].
        data = _read_until(sock, b"data: [DONE]")
    finally:
        sock.close()
    frames = re.findall(rb"data: ([^\n]*)\n", data)
    assert frames[-1] == b"[DONE]"
    assert orjson.loads(frames[-2])["error"]["code"] == "slow_client"
    assert wait_until(lambda: _stalls(small_buffer, "buffer_full") == 1)


def test_a_reader_that_takes_nothing_for_the_stall_timeout_is_disconnected() -> None:
    running = _gateway(stream_buffer_tokens=None, stall_timeout=0.5)
    errors = _ErrorLines()
    server_log = logging.getLogger("uvicorn.error")  # where a response left incomplete is reported
    server_log.addHandler(errors)
    try:
        before = running.engine_tokens()
        sock = _non_reading_client(running.base_url)
        try:
            assert wait_until(lambda: running.engine_tokens() > before)
            assert wait_until(lambda: _stalls(running, "send_timeout") == 1, timeout=30)
            assert wait_until(running.engine_idle)
            assert running.engine_tokens() - before < MAX_TOKENS_ALL_CHOICES / 4
            data = _read_until(sock, b"data: [DONE]")
        finally:
            sock.close()
        assert b"data: [DONE]" not in data, "the server closed the connection: a stalled stream has no end frame"
        assert b"HTTP/1.1 200" in data
        assert wait_until(lambda: not running.server.server_state.tasks), "the stalled request ended"
        assert not errors.lines, f"a client that stopped reading is no server error: {errors.lines}"
    finally:
        server_log.removeHandler(errors)
        stop_gateway(running)


class _ErrorLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

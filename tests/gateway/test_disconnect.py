"""A client that goes away frees its engine slot, streaming or not, before or after the first token, at any
concurrency: checked on the engine's own counters (requests it still holds, tokens it generated), on an engine
with a timing model so that work nobody aborted would show."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import httpx
import orjson
import pytest
import structlog.testing

from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000, "ignore_eos": True}
LATE_TOKENS = 400
"""Tokens an aborted request may still get after its client left (0.8 s of the timed engine; 4,000 without abort)."""


def _request_bytes(body: dict[str, object]) -> bytes:
    payload = orjson.dumps(body)
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


def _raw_request(base_url: str, body: dict[str, object]) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(_request_bytes(body))
    return sock


def requests_with_status(gateway: RunningGateway, status: str) -> float:
    return gateway.metric("gateway_requests_total", status=status)


def test_disconnect_mid_stream_aborts_the_engine_request(timed_gateway: RunningGateway) -> None:
    before = timed_gateway.engine_tokens()
    with (
        httpx.Client(base_url=timed_gateway.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert timed_gateway.driver_in_flight() == 1
    assert wait_until(timed_gateway.engine_idle)
    assert timed_gateway.engine_tokens() - before <= LATE_TOKENS


def test_disconnect_while_waiting_for_a_whole_response_aborts_the_engine_request(
    timed_gateway: RunningGateway,
) -> None:
    for body in (LONG, {**LONG, "stream": True}):
        before = timed_gateway.engine_tokens()
        sock = _raw_request(timed_gateway.base_url, body)
        assert wait_until(lambda: timed_gateway.engine_unfinished() == 1)
        sock.close()
        assert wait_until(timed_gateway.engine_idle)
        assert timed_gateway.engine_tokens() - before <= LATE_TOKENS


def test_disconnect_before_the_first_token_aborts_the_engine_request() -> None:
    slow_prefill = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "timing": {"prefill_seconds_per_token": 0.2}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(slow_prefill)
    try:
        sock = _raw_request(running.base_url, {**LONG, "stream": True})
        assert wait_until(lambda: running.driver_in_flight() == 1)
        sock.close()
        assert wait_until(running.engine_idle, timeout=20)
        assert running.engine_tokens() <= 1, "at most the token of the prefill step that was under way"
    finally:
        stop_gateway(running)


FRAMES = 3
STEPS_AFTER_CLOSE = 20
"""Engine steps a stream may still run after its client closed (the engine is paced by the event loop)."""


async def _read_frames_then_leave(host: str, port: int, body: bytes, rst: bool) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(body)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    seen = b""
    while seen.count(b"data: {") < FRAMES:
        chunk = await reader.read(65536)
        assert chunk, "the stream ended before the client left"
        seen += chunk
    if rst:  # SO_LINGER 0: the kernel sends a RST instead of a FIN
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()
    return seen.count(b"data: {")


def test_a_hundred_and_more_streams_closed_after_three_frames_stop_their_engine_work(
    timed_gateway: RunningGateway,
) -> None:
    clients = 128
    host, port = timed_gateway.base_url.removeprefix("http://").split(":")
    body = _request_bytes({**LONG, "max_tokens": 2000, "stream": True})
    tokens_before = timed_gateway.engine_tokens()
    left_before = requests_with_status(timed_gateway, "499")

    async def crowd() -> list[int]:
        return await asyncio.gather(
            *(_read_frames_then_leave(host, int(port), body, rst=i % 2 == 1) for i in range(clients))
        )

    frames = asyncio.run(crowd())
    assert wait_until(timed_gateway.engine_idle, timeout=60)
    generated = timed_gateway.engine_tokens() - tokens_before
    # Without aborts the engine would generate 2,000 tokens for each of them.
    assert generated <= sum(frames) + clients * STEPS_AFTER_CLOSE, generated
    assert wait_until(lambda: requests_with_status(timed_gateway, "499") - left_before == clients)


def test_a_client_that_leaves_while_sending_its_body_is_logged_as_gone_not_as_a_bad_request(
    timed_gateway: RunningGateway,
) -> None:
    host, port = timed_gateway.base_url.removeprefix("http://").split(":")
    with structlog.testing.capture_logs() as logs:
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        sock.close()
        assert wait_until(lambda: any(line.get("path") == "/v1/chat/completions" for line in logs))
    line = next(line for line in logs if line.get("path") == "/v1/chat/completions")
    assert line["status"] == 499 and line["error_code"] == "client_disconnected"


def test_a_hundred_clients_waiting_for_whole_responses_that_leave_stop_their_engine_work(
    timed_gateway: RunningGateway,
) -> None:
    clients = 100
    socks = [_raw_request(timed_gateway.base_url, {**LONG, "max_tokens": 2000}) for _ in range(clients)]
    try:
        assert wait_until(lambda: timed_gateway.driver_in_flight() == clients, timeout=30)
    finally:
        before = timed_gateway.engine_tokens()
        for sock in socks:
            sock.close()
    assert wait_until(timed_gateway.engine_idle, timeout=60)
    assert timed_gateway.engine_tokens() - before <= clients * STEPS_AFTER_CLOSE


def test_a_client_gone_before_its_response_began_is_a_499_not_an_application_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow_prefill = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "timing": {"prefill_seconds_per_token": 0.2}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(slow_prefill)
    try:
        with caplog.at_level(logging.ERROR):
            for body in ({**LONG, "stream": True}, LONG):
                sock = _raw_request(running.base_url, body)
                assert wait_until(lambda: running.driver_in_flight() == 1)
                sock.close()
                assert wait_until(running.engine_idle, timeout=20)
            assert wait_until(lambda: requests_with_status(running, "499") == 2)
    finally:
        stop_gateway(running)
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], errors

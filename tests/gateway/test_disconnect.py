"""A client that goes away frees its engine slot, streaming or not, before or after the first token."""

from __future__ import annotations

import socket

import httpx
import orjson

from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "ignore_eos": True}


def _raw_request(base_url: str, body: dict[str, object]) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = orjson.dumps(body)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_disconnect_mid_stream_aborts_the_engine_request(gateway: RunningGateway) -> None:
    with (
        httpx.Client(base_url=gateway.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert gateway.driver_in_flight() == 1
    assert wait_until(lambda: gateway.engine_unfinished() == 0 and gateway.driver_in_flight() == 0)


def test_disconnect_while_waiting_for_a_whole_response_aborts_the_engine_request() -> None:
    slow = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(slow)
    try:
        sock = _raw_request(running.base_url, LONG)
        assert wait_until(lambda: running.engine_unfinished() == 1)
        sock.close()
        assert wait_until(lambda: running.engine_unfinished() == 0 and running.driver_in_flight() == 0)
        sock = _raw_request(running.base_url, {**LONG, "stream": True})
        assert wait_until(lambda: running.engine_unfinished() == 1)
        sock.close()
        assert wait_until(lambda: running.engine_unfinished() == 0 and running.driver_in_flight() == 0)
    finally:
        stop_gateway(running)


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
        assert wait_until(lambda: running.engine_unfinished() == 0 and running.driver_in_flight() == 0, timeout=20)
    finally:
        stop_gateway(running)

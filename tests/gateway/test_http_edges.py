"""The edges of the error contract: whatever the gateway or its HTTP server answers is the called API's error JSON,
a server error leaves the connection usable, and no URL is built from the client's Host header."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from backends.interface import Event, EventStream, GenerateRequest
from backends.registry import build_backend
from gateway.capabilities import WrappedBackend
from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway
from .test_connections import read_head

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
RESPONSES = {"model": MODEL, "input": "x", "max_output_tokens": 16}


def _exchange(base_url: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw request on a fresh connection: the status, headers and body of the answer (read until the close)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def _openai_error(body: bytes) -> dict[str, Any]:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": {}}}, "tool_choice.type"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": []}}, "tool_choice.type"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": ["function"]}}, "tool_choice.type"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": {}, "function": {"name": "f"}}]}, "tools[0].type"),
        ("/v1/responses", {**RESPONSES, "tool_choice": {"type": {}}}, "tool_choice.type"),
        ("/v1/responses", {**RESPONSES, "tool_choice": {"type": ["function"]}}, "tool_choice.type"),
        ("/v1/responses", {**RESPONSES, "tools": [{"type": {}, "name": "f"}]}, "tools[0].type"),
    ],
)
def test_a_discriminator_of_the_wrong_type_is_a_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert _openai_error(response.content)["param"] == param
    assert http.post(path, json={**body, "tools": None, "tool_choice": None}).status_code == 200, "same connection"


def test_a_token_id_below_zero_is_named_with_its_bound(http: httpx.Client) -> None:
    for prompt, param in (([-1], "prompt[0]"), ([[5, -1]], "prompt[0][1]")):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        error = _openai_error(response.content)
        assert response.status_code == 400 and error["param"] == param, error
        assert ">= 0" in error["message"] and error["code"] == "integer_below_min_value", error


@pytest.mark.parametrize("path", ["/metrics/", "/health/", "/ready/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_built_from_the_host_header(
    gateway: RunningGateway, path: str
) -> None:
    raw = f"GET {path} HTTP/1.1\r\nHost: attacker.example\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = _exchange(gateway.base_url, raw)
    assert status == 404 and "location" not in headers
    error = _openai_error(body)
    assert error["type"] == "not_found_error" and path in error["message"]


def test_a_post_with_a_trailing_slash_gets_the_apis_404(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions/", json=CHAT)
    assert response.status_code == 404 and "location" not in response.headers
    assert _openai_error(response.content)["type"] == "not_found_error"
    messages = http.post("/v1/messages/", json={"model": MODEL, "max_tokens": 1, "messages": []})
    assert messages.status_code == 404
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("path", "anthropic"), [("/v1/chat/completions", False), ("/health", False), ("/v1/messages", True)]
)
@pytest.mark.parametrize("oversized", ["x-request-id", "one-megabyte-header"])
def test_oversized_headers_get_a_431_in_the_apis_error_json(
    gateway: RunningGateway, path: str, anthropic: bool, oversized: str
) -> None:
    size = 64 * 1024 if oversized == "x-request-id" else 1024 * 1024
    raw = f"GET {path} HTTP/1.1\r\nHost: a\r\n{oversized}: {'a' * size}\r\n\r\n".encode()
    status, headers, body = _exchange(gateway.base_url, raw)
    assert status == 431 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    if anthropic:
        assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
    else:
        assert _openai_error(body)["code"] == "header_too_large"


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_a_request_the_http_parser_refuses_gets_a_400_in_the_apis_error_json(
    gateway: RunningGateway, path: str, anthropic: bool
) -> None:
    raw = f"POST {path} HTTP/1.1\r\nHost: a\r\nX-Bad: a\nb\r\nContent-Length: 2\r\n\r\n{{}}".encode()
    status, headers, body = _exchange(gateway.base_url, raw)
    assert status == 400 and headers["content-type"] == "application/json"
    if anthropic:
        assert orjson.loads(body)["type"] == "error"
    else:
        assert _openai_error(body)["code"] == "bad_request"


class BuggyBackend(WrappedBackend):
    """Test double: the reference backend with a bug in its ``generate`` (an exception no one expects)."""

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        raise RuntimeError("an injected bug")


@pytest.fixture(scope="module")
def buggy() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference"}], models=[{"name": MODEL, "backends": ["reference"]}]
    )
    running = start_gateway(config, backends={"reference": BuggyBackend(build_backend(config.backends[0]))})
    yield running
    stop_gateway(running)


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSES)])
def test_a_server_error_is_the_apis_500_and_the_connection_stays_usable(
    buggy: RunningGateway, path: str, body: dict[str, Any]
) -> None:
    payload = orjson.dumps(body)
    request = (
        f"POST {path} HTTP/1.1\r\nHost: a\r\nX-Request-ID: bug-1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    host, port = buggy.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        reader = sock.makefile("rb")
        sock.sendall(request)
        status, headers, answer = _read_response(reader)
        assert status == 500 and headers["x-request-id"] == "bug-1"
        error = _openai_error(answer)
        assert error["code"] == "internal_error" and "bug-1" in error["message"] and "injected" not in error["message"]
        keeps_open = headers.get("connection") != "close"
        if keeps_open:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
            assert _read_response(reader)[0] == 200, "the connection a 500 left open serves the next request"
    assert keeps_open, "a 500 for a bug closes nothing: the client's pool reuses the connection"


def _read_response(reader: Any) -> tuple[int, dict[str, str], bytes]:
    """One response with a content-length from a kept-alive connection."""
    status = int(reader.readline().split()[1])
    headers = read_head(reader)
    return status, headers, reader.read(int(headers["content-length"]))


def test_the_access_log_times_the_request_within_the_clients_wait(gateway: RunningGateway) -> None:
    """``duration_ms`` is the request's own time: it lies within the span from before the client sent it to after
    the gateway finished it (its log line written), whatever the request's fate."""
    began = time.perf_counter()
    with captured_logs(gateway) as logs, httpx.Client(base_url=gateway.base_url) as http:
        http.post("/v1/chat/completions", json=CHAT)
        http.post("/v1/chat/completions", json={**CHAT, "tool_choice": {"type": {}}})
    window_ms = (time.perf_counter() - began) * 1000
    durations = [line["duration_ms"] for line in logs if line.get("event") == "request"]
    assert len(durations) == 2 and all(0 < duration < window_ms for duration in durations), (durations, window_ms)

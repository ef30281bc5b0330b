"""The gateway's middleware stack: every request has an id, a log line and a count, whatever its fate; and a
middleware a library user adds (Starlette's GZip) sees every body frame.

Streamed frames normally skip the ASGI middleware (``gateway.connections.DirectBody``); a middleware that compresses
bodies would then get the headers and only the frames that happened to go through ``send``, and the client a
broken gzip stream. The GZip tests run a real gateway with GZip added the way a user adds it and read the responses
through the openai SDK and raw HTTP, both of which decompress.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware

from gateway.config import GatewayConfig
from gateway.middleware import BodyLimitMiddleware, RequestIdMiddleware, WithoutDirectBody, body_rewriters

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway

HELLO = [{"role": "user", "content": "Tell me about the module."}]
STREAM_TOKENS = 96
"""Long enough that a stream has many frames, most of them written while its task waits (the direct path)."""


def add_gzip(app: FastAPI) -> None:
    """GZip as a user adds it, compressing every body, event streams included (as older Starlette did by default,
    and as an operator who wants compressed streams configures it)."""
    app.add_middleware(GZipMiddleware, minimum_size=0, exclude_content_types=())


@pytest.fixture(scope="module")
def gzip_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config, prepare=add_gzip)
    yield running
    stop_gateway(running)


def test_a_user_added_gzip_compresses_whole_json_bodies(gzip_gateway: RunningGateway) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 32, "seed": 3}
    response = httpx.post(f"{gzip_gateway.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip"
    assert response.headers["x-request-id"], "the gateway's own middleware still run inside the user's"
    completion = orjson.loads(response.content)
    client = openai.OpenAI(base_url=f"{gzip_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=32, seed=3)
    assert again.choices[0].message.content == completion["choices"][0]["message"]["content"]


def test_a_user_added_gzip_gets_every_frame_of_a_stream(gzip_gateway: RunningGateway) -> None:
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": STREAM_TOKENS,
        "seed": 11,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    url = f"{gzip_gateway.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-encoding"] == "gzip"
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [orjson.loads(payload) for payload in payloads[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks[:-1])
    whole = httpx.post(url, json={**body, "stream": False}, timeout=60).json()
    assert streamed == whole["choices"][0]["message"]["content"]


def test_the_openai_sdk_streams_through_a_user_added_gzip(gzip_gateway: RunningGateway) -> None:
    client = openai.OpenAI(base_url=f"{gzip_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    args = {"model": MODEL, "messages": HELLO, "max_tokens": STREAM_TOKENS, "seed": 5}
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    whole = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_only_middleware_known_to_pass_bodies_through_keep_direct_writes() -> None:
    ours = [Middleware(RequestIdMiddleware), Middleware(BodyLimitMiddleware, max_body_bytes=1)]
    assert body_rewriters(ours) == []
    assert body_rewriters([Middleware(GZipMiddleware), *ours]) == ["GZipMiddleware"]


def test_the_gateways_own_stack_keeps_direct_writes(gateway: RunningGateway, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200  # the stack is built by the first call
    assert not isinstance(gateway.app.middleware_stack, WithoutDirectBody), body_rewriters(gateway.app.user_middleware)


def test_every_fate_has_an_id_a_log_line_and_a_count(gateway: RunningGateway) -> None:
    """A routed answer, a validation 400, an unknown model's 404 and a drain's 503: each response names its request,
    each request has one access-log line with that id and status, and each is counted once (the routed one by model
    and backend, the others with empty labels and their error code)."""
    url = f"{gateway.base_url}/v1/chat/completions"
    fates = [
        ({"model": MODEL, "messages": HELLO, "max_tokens": 2}, 200, None),
        ({"model": MODEL, "messages": "x"}, 400, "invalid_type"),
        ({"model": "no-such-model", "messages": HELLO}, 404, "model_not_found"),
    ]

    def counted(status: int, code: str | None) -> float:
        labels = {"model": MODEL, "backend": "reference"} if code is None else {"model": "", "backend": ""}
        errors = gateway.metric("gateway_request_errors_total", **labels, code=code) if code else 0.0
        return gateway.metric("gateway_requests_total", **labels, status=str(status)) + errors

    before = [counted(status, code) for _, status, code in fates] + [counted(503, "draining")]
    with captured_logs(gateway) as logs:
        answers = [httpx.post(url, json=body, timeout=60) for body, _, _ in fates]
        gateway.state.begin_drain()
        try:
            answers.append(httpx.post(url, json=fates[0][0], timeout=60))
            assert httpx.get(f"{gateway.base_url}/v1/models").status_code == 200, "a drain refuses only generation"
        finally:
            gateway.state.draining = False
    assert [a.status_code for a in answers] == [200, 400, 404, 503]
    assert answers[-1].json()["error"]["code"] == "draining" and answers[-1].headers["retry-after"] == "1"
    lines = {line["request_id"]: line for line in logs if line.get("event") == "request"}
    for answer in answers:
        line = lines[answer.headers["x-request-id"]]
        assert line["status"] == answer.status_code and line["method"] == "POST"
    after = [counted(status, code) for _, status, code in fates] + [counted(503, "draining")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 2, 2, 2]

"""Clients of the gateway get OpenAI's format whatever LMDeploy sent: SDK and raw HTTP, checked against the schemas."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.server_config import ApiKeyConfig

from ...budget_client import (
    FrozenClock,
    charge_of_next_request,
    charged,
    post,
    prompt_estimate,
    remaining_tokens,
    stream_and_hang_up,
)
from ...conformance import OpenAISchemas
from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from .conftest import PUBLIC_MODEL, gateway_config
from .harness.server import HarnessNode


@pytest.fixture(scope="module")
def client(lm_gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lm_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(lm_gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lm_gateway.base_url, timeout=60) as c:
        yield c


def messages(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def sse(response: httpx.Response) -> list[bytes]:
    return [line[6:].encode() for line in response.iter_lines() if line.startswith("data: ")]


def stream_chunks(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        payloads = sse(response)
        status = response.status_code
    assert payloads[-1] == b"[DONE]"
    return status, [orjson.loads(p) for p in payloads[:-1]]


def test_chat_completion_conforms_and_matches_the_stream(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    completion = client.chat.completions.create(model=PUBLIC_MODEL, messages=messages("Hello world! How are you"))
    assert completion.choices[0].message.content == "Hello world! How are you"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    body = {"model": PUBLIC_MODEL, "messages": messages("Hello world! How are you")}
    schemas.check("CreateChatCompletionResponse", http.post("/v1/chat/completions", json=body).json())
    status, chunks = stream_chunks(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 200
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["choices"][0]["delta"]["content"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello world! How are you"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_stop_string_longer_than_one_token_is_enforced_by_the_gateway(
    client: openai.OpenAI, http: httpx.Client, node: HarnessNode
) -> None:
    content = "The quick brown fox jumps over the lazy dog and on [[stub delay=0.02 tag=gw-stop]]"
    completion = client.chat.completions.create(model=PUBLIC_MODEL, messages=messages(content), stop=["lazy dog"])
    assert completion.choices[0].message.content == "The quick brown fox jumps over the "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    body = {"model": PUBLIC_MODEL, "messages": messages(content), "stop": ["lazy dog", "never"]}
    _, chunks = stream_chunks(http, "/v1/chat/completions", body)
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "The quick brown fox jumps over the "
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: len(node.events(event="cancel", tag="gw-stop")) == 2)


def test_n_choices_and_usage_through_the_sdk(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=PUBLIC_MODEL, messages=messages("Hello there"), n=2, seed=3)
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.message.content == "Hello there" for c in completion.choices)
    assert completion.usage is not None and completion.usage.completion_tokens == 4


def test_logprobs_conform_and_list_the_chosen_token(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = {"model": PUBLIC_MODEL, "messages": messages("Hello world"), "logprobs": True, "top_logprobs": 2}
    reply = http.post("/v1/chat/completions", json=body).json()
    schemas.check("CreateChatCompletionResponse", reply)
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world"]
    assert all(c["top_logprobs"][0]["token"] == c["token"] and len(c["top_logprobs"]) == 2 for c in content)


def test_completions_with_text_and_token_prompts_conform(http: httpx.Client, schemas: OpenAISchemas) -> None:
    reply = http.post("/v1/completions", json={"model": PUBLIC_MODEL, "prompt": "The quick brown fox"}).json()
    schemas.check("CreateCompletionResponse", reply)
    assert reply["choices"][0]["text"] == "The quick brown fox"
    assert reply["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},  # the node reported no hits: none are claimed
        "prompt_cache_hit_tokens": 0,
        "prompt_cache_miss_tokens": 4,
    }
    body = {"model": PUBLIC_MODEL, "prompt": [[315, 441], [288]], "max_tokens": 5}
    _, chunks = stream_chunks(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        schemas.check_completion_chunk(chunk)
    by_index: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    assert by_index == {0: "Hello world", 1: "The"}


def test_reasoning_and_tool_calls_reach_the_client_in_openai_fields(http: httpx.Client, schemas: OpenAISchemas) -> None:
    content = (
        'Need weather</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {
        "model": PUBLIC_MODEL,
        "messages": messages(content),
        "tools": [tool],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    reply = http.post("/v1/chat/completions", json=body).json()
    schemas.check("CreateChatCompletionResponse", reply)
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "Need weather"
    assert message["content"] == "Sure."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    _, chunks = stream_chunks(http, "/v1/chat/completions", body)
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'


@pytest.mark.parametrize(
    ("content", "status", "error_type"),
    [
        ("hello " * 300, 400, "invalid_request_error"),
        ("Hi [[stub fail=INTERNAL_ENGINE_ERROR after=0]]", 502, "server_error"),
        ("Hi [[stub fail=NO_QUEUE after=0]]", 503, "server_error"),
    ],
    ids=["context-length", "engine-failure-before-first-token", "engine-unavailable"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_errors_before_the_first_token_are_openai_shaped_with_the_right_status(
    http: httpx.Client, schemas: OpenAISchemas, content: str, status: int, error_type: str, stream: bool
) -> None:
    body = {"model": PUBLIC_MODEL, "messages": messages(content), "stream": stream}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    schemas.check("ErrorResponse", response.json())
    assert response.json()["error"]["type"] == error_type
    assert "object" not in response.json()["error"], "LMDeploy's flat body never reaches the client"


def test_engine_failure_after_the_first_token_is_an_error_frame_then_done(http: httpx.Client) -> None:
    body = {
        "model": PUBLIC_MODEL,
        "messages": messages("Hello world again [[stub fail=INTERNAL_ENGINE_ERROR after=2]]"),
    }
    status, chunks = stream_chunks(http, "/v1/chat/completions", body)
    assert status == 200
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]) == "Hello world"
    assert chunks[-1]["error"]["type"] == "server_error" and chunks[-1]["error"]["message"]


def test_parameters_lmdeploy_cannot_honour_are_a_400_naming_them(http: httpx.Client) -> None:
    for body, param in (
        ({"messages": messages("x"), "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "seed": 1}, "seed"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 1}, "echo"),  # no prompt logprobs upstream
        ({"prompt": "x", "echo": True, "max_tokens": 0}, "max_tokens"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = http.post(path, json={"model": PUBLIC_MODEL, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param


def test_tokenizer_endpoints_say_lmdeploy_backends_do_not_expose_their_tokenizer(http: httpx.Client) -> None:
    for method, path, body in (
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
    ):
        response = http.request(method, path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "model" and "lmdeploy" in response.json()["error"]["message"]


def test_wrong_upstream_key_is_a_502_for_the_client(node: HarnessNode) -> None:
    running = start_gateway(gateway_config([node.url], api_key="sk-wrong", model="stub-model"))
    try:
        response = httpx.post(
            f"{running.base_url}/v1/chat/completions", json={"model": PUBLIC_MODEL, "messages": messages("Hi")}
        )
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_auth"
    finally:
        stop_gateway(running)


def _raw_stream(base_url: str, content: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = orjson.dumps({"model": PUBLIC_MODEL, "messages": messages(content), "stream": True})
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_client_disconnect_mid_stream_cancels_the_engine_request(lm_gateway: RunningGateway, node: HarnessNode) -> None:
    sock = _raw_stream(lm_gateway.base_url, "one two three four five six seven [[stub delay=0.2 tag=gone-mid]]")
    received = b""
    while b"data: " not in received:
        received += sock.recv(65536)
    sock.close()
    assert wait_until(lambda: node.events(event="cancel", tag="gone-mid"))
    assert not node.events(event="finish", tag="gone-mid")


def test_client_disconnect_before_the_first_token_cancels_the_engine_request(
    lm_gateway: RunningGateway, node: HarnessNode
) -> None:
    sock = _raw_stream(lm_gateway.base_url, "one two [[stub first_delay=30 tag=gone-early]]")
    assert wait_until(lambda: node.events(event="start", tag="gone-early"))
    sock.close()
    assert wait_until(lambda: node.events(event="cancel", tag="gone-early"))


def test_the_gateways_request_deadline_closes_the_upstream_request(node: HarnessNode) -> None:
    """The backend is told of no deadline: the gateway's own, when it passes, closes the event iterator, and that
    closes the upstream stream, so the node cancels the work."""
    config = gateway_config([node.url], failure_threshold=1000)
    config.server.streams.request_timeout = 1.0
    running = start_gateway(config)
    try:
        body = {"model": PUBLIC_MODEL, "messages": messages("one two [[stub first_delay=30 tag=past-deadline]]")}
        response = httpx.post(f"{running.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 504, response.text
        assert wait_until(lambda: node.events(event="cancel", tag="past-deadline"))
    finally:
        stop_gateway(running)


def test_ready_and_metrics_show_the_node(lm_gateway: RunningGateway, node: HarnessNode, http: httpx.Client) -> None:
    ready = http.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["backends"]["lm"]["reason"] == "1/1 LMDeploy nodes healthy"
    metrics = http.get("/metrics").text
    assert f'gateway_lmdeploy_node_healthy{{backend="lm",node="{node.url}"}} 1.0' in metrics
    assert f'gateway_lmdeploy_node_requests_total{{backend="lm",node="{node.url}"}}' in metrics
    assert "gateway_lmdeploy_node_first_byte_seconds_count" in metrics


def test_requests_one_after_another_reuse_one_pooled_upstream_connection(http: httpx.Client) -> None:
    def created() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('gateway_lmdeploy_connections_created_total{backend="lm"}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("gateway_lmdeploy_connections_created_total is not exported")

    body = {"model": PUBLIC_MODEL, "messages": messages("one two"), "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=body).status_code == 200  # a pooled connection exists now
    before = created()
    assert before >= 1
    for _ in range(3):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert created() == before


def test_a_key_that_hangs_up_or_whose_stream_fails_pays_for_what_it_read(node: HarnessNode) -> None:
    """Through LMDeploy's real api_server: a stream that ends before its usage chunk (the client hung up, the
    engine failed mid-stream) is charged the tokens the gateway forwarded plus its prompt estimate."""
    key, label, tpm, step = "sk-metered-0123456789", "team", 100_000, 4
    config = gateway_config([node.url])
    config.server.auth.api_keys = [ApiKeyConfig(key=key, name=label, tokens_per_minute=tpm)]
    config.server.auth.admin_api_key = "sk-admin-0123456789"
    running = start_gateway(config, budget_clock=FrozenClock())
    try:
        body: dict[str, Any] = {
            "model": PUBLIC_MODEL,
            "messages": messages(f"one two three four five six seven [[stub delay=0.05 chunk={step} tag=metered]]"),
            "max_tokens": 200,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 1,
        }
        read = stream_and_hang_up(running.base_url, key, body, tokens=60)
        charge = charge_of_next_request(running, label, 0)
        completion = charge - prompt_estimate({**body, "stream": True})
        assert read <= completion <= read + step, f"read {read} tokens, charged {completion} for them"
        assert wait_until(lambda: node.events(event="cancel", tag="metered"))

        failing = {
            **body,
            "messages": messages("one two three four five [[stub chunk=2 fail=INTERNAL_ENGINE_ERROR after=12]]"),
        }
        before = charged(running, label)
        got = stream_and_hang_up(running.base_url, key, failing, tokens=10_000)  # reads to the error frame
        assert 0 < got < 200
        charge = charge_of_next_request(running, label, before)
        assert charge == prompt_estimate({**failing, "stream": True}) + got
        probe = {"model": PUBLIC_MODEL, "messages": messages("Hello world"), "max_tokens": 4}
        spent = charged(running, label)
        response = post(running.base_url, key, probe)
        assert remaining_tokens(response) == tpm - spent - (prompt_estimate(probe) + 4), "the headers tell the same"
    finally:
        stop_gateway(running)


def test_cache_hits_are_what_the_node_reported_and_none_when_it_reported_none(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    def cache_fields(usage: dict[str, Any]) -> tuple[int, int, int]:
        assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_cache_hit_tokens"], usage["prompt_tokens"]

    hit = client.chat.completions.create(model=PUBLIC_MODEL, messages=messages("Hello there [[stub cached=5]]"))
    assert hit.usage is not None
    assert cache_fields(hit.usage.model_dump())[:2] == (5, 5)
    body = {"model": PUBLIC_MODEL, "messages": messages("Hello there [[stub cached=5]]")}
    _, chunks = stream_chunks(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert cache_fields(chunks[-1]["usage"])[:2] == (5, 5)
    miss = client.chat.completions.create(model=PUBLIC_MODEL, messages=messages("Hello there"))
    assert miss.usage is not None
    assert cache_fields(miss.usage.model_dump()) == (0, 0, miss.usage.prompt_tokens)

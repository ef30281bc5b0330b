"""The gateway in front of LMDeploy's real proxy (``lmdeploy serve proxy``, from the harness virtualenv) with real
api_server nodes (stub engine) registered through its ``/nodes/*`` routes: the proxy is recognised by itself, its
view of its nodes is the gateway's readiness, and its 200-wrapped errors are failures with their real status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from backends.errors import UnavailableError
from backends.lmdeploy import LMDeployBackend
from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from ...gateway.test_routing import _assert_whole_answer, _samples, _served_by
from .conftest import MAIN_NODE_ARGS, PUBLIC_MODEL, backend_config, gateway_config, running_backend
from .harness.proxy import DECODE, PREFILL, HarnessProxy, make_proxy
from .harness.server import API_KEY, HarnessNode, free_port, make_node
from .test_backend import chat, collect

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def proxy(harness_dir: Path, node: HarnessNode) -> Iterator[HarnessProxy]:
    """A proxy (with the same API key as its node) in front of the shared node, registered as a Hybrid node."""
    started = make_proxy(harness_dir / "proxy", "--api-keys", API_KEY).start()
    started.add(node)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def proxied(proxy: HarnessProxy) -> Iterator[RunningGateway]:
    """A gateway whose backend names only the proxy's url: nothing says it is a proxy."""
    running = start_gateway(gateway_config([proxy.url], failure_threshold=1000))
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def client(proxied: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxied.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(proxied: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=proxied.base_url, timeout=60) as c:
        yield c


def _say(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def test_the_proxy_is_recognised_and_ready_from_its_view_of_its_nodes(
    http: httpx.Client, proxied: RunningGateway
) -> None:
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["backends"]["lm"]["ready"], ready.text
    backend = unwrapped(proxied.state.backends["lm"])
    assert isinstance(backend, LMDeployBackend)
    assert backend.readiness() == (True, "1/1 LMDeploy nodes healthy")
    (only,) = backend.pool.nodes
    assert only.kind == "proxy" and only.reason == "proxy with 1 Hybrid node(s) serving stub-model"
    assert _proxy_nodes(http, only.url) == {"Hybrid": 1, "Prefill": 0, "Decode": 0}


def test_chat_and_stream_through_the_proxy(client: openai.OpenAI, node: HarnessNode) -> None:
    completion = client.chat.completions.create(
        model=PUBLIC_MODEL, messages=_say("Hello world! How are you [[stub tag=px-chat]]")
    )  # type: ignore[arg-type]
    assert completion.choices[0].message.content == "Hello world! How are you"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=PUBLIC_MODEL,
            messages=_say("one two three four five six [[stub delay=0.01 tag=px-stream]]"),  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four five six"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert (
        len(node.events(event="finish", tag="px-chat")) == 1 and len(node.events(event="finish", tag="px-stream")) == 1
    )


def test_a_tool_call_through_the_proxy(http: httpx.Client) -> None:
    content = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"model": PUBLIC_MODEL, "messages": _say(content), "tools": [WEATHER]}
    reply = http.post("/v1/chat/completions", json=body).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "Sure."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_a_responses_request_through_the_proxy_is_served_as_chat(client: openai.OpenAI, node: HarnessNode) -> None:
    response = client.responses.create(model=PUBLIC_MODEL, input="Hello world again [[stub tag=px-resp]]")
    assert response.status == "completed" and response.output_text == "Hello world again"
    assert response.usage is not None and response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert len(node.events(event="start", tag="px-resp")) == 1


def test_text_completions_go_to_the_proxys_completions_route(
    client: openai.OpenAI, http: httpx.Client, node: HarnessNode
) -> None:
    """The proxy has no /generate: a text prompt goes to its /v1/completions; a token-id prompt cannot go."""
    reply = client.completions.create(model=PUBLIC_MODEL, prompt="The quick brown fox [[stub tag=px-cmpl]]")
    assert reply.choices[0].text == "The quick brown fox" and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens > 4
    streamed = list(client.completions.create(model=PUBLIC_MODEL, prompt="one two three", max_tokens=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "one two"
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["length"]
    assert len(node.events(event="finish", tag="px-cmpl")) == 1
    refused = http.post("/v1/completions", json={"model": PUBLIC_MODEL, "prompt": [315, 441]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text


def test_a_client_that_leaves_closes_the_stream_through_the_proxy(http: httpx.Client, node: HarnessNode) -> None:
    words = " ".join(f"w{i}" for i in range(20))
    body = {"model": PUBLIC_MODEL, "messages": _say(f"{words} [[stub delay=0.2 tag=px-leave]]"), "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert orjson.loads(first[6:])["choices"][0]["delta"]
    assert wait_until(lambda: node.events(event="cancel", tag="px-leave"), timeout=30), "the node's engine stopped"
    assert not node.events(event="finish", tag="px-leave")


# A proxy of its own, whose node is killed and taken away.


@pytest.fixture(scope="module")
def lonely(harness_dir: Path, model_dir: Path) -> Iterator[HarnessNode]:
    started = make_node(harness_dir / "lonely", "lonely", *MAIN_NODE_ARGS, model_dir=model_dir).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def lossy(harness_dir: Path, lonely: HarnessNode) -> Iterator[HarnessProxy]:
    started = make_proxy(harness_dir / "lossy", "--api-keys", API_KEY).start()
    started.add(lonely)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def watched(lossy: HarnessProxy) -> Iterator[RunningGateway]:
    """A gateway with the lossy proxy (said to be one) and a reference fallback behind a breaker that opens at once."""
    lm = backend_config([lossy.url], node_kind="proxy", failure_threshold=1000)
    config = GatewayConfig(
        backends=[{"name": "ref", "kind": "reference"}, lm],
        models=[
            {"name": "lm-only", "backends": ["lm"], "circuit_breaker": {"failure_threshold": 1000}},
            {
                "name": "lm-first",
                "backends": ["lm"],
                "fallbacks": ["ref"],
                "circuit_breaker": {"failure_threshold": 1, "cooldown_seconds": 600},
            },
        ],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def watched_http(watched: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=watched.base_url, timeout=60) as c:
        yield c


def _node_errors(http: httpx.Client, proxy: HarnessProxy) -> dict[str, float]:
    """``gateway_lmdeploy_node_errors_total`` of the proxy, by kind."""
    found = {}
    for (name, labels), value in _samples(http).items():
        named = dict(labels)
        if name == "gateway_lmdeploy_node_errors_total" and named.get("node") == proxy.url:
            found[named["kind"]] = value
    return found


def _proxy_nodes(http: httpx.Client, proxy: str) -> dict[str, float]:
    """``gateway_lmdeploy_proxy_nodes`` of the proxy, by role."""
    return {
        dict(labels)["role"]: value
        for (name, labels), value in _samples(http).items()
        if name == "gateway_lmdeploy_proxy_nodes" and dict(labels).get("node") == proxy
    }


def _ask(http: httpx.Client, model: str, *, stream: bool) -> httpx.Response:
    body = {"model": model, "messages": _say("Hello there"), "max_tokens": 4, "stream": stream}
    return http.post("/v1/chat/completions", json=body)


def test_a_200_wrapped_proxy_error_is_a_502_and_trips_the_breaker_to_the_fallback(
    watched_http: httpx.Client, lossy: HarnessProxy, lonely: HarnessNode
) -> None:
    # A node that died: the proxy lists it until its sweep 90 s later, and answers 200 {"error_code": 10402}.
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused, as a killed node's port
    lossy.add(dead)  # first, so the proxy never lists no node (the gateway would be not ready meanwhile)
    lossy.remove(lonely)
    try:
        for stream in (False, True):
            failed = _ask(watched_http, "lm-only", stream=stream)
            assert failed.status_code == 502, failed.text
            assert failed.json()["error"]["type"] == "server_error"
        assert _node_errors(watched_http, lossy) == {"proxy_error": 2}, (
            "the proxy's 10402 answers, counted as what they are"
        )
        fell_back = _ask(watched_http, "lm-first", stream=True)
        assert _served_by(fell_back) == "ref"
        _assert_whole_answer(fell_back, True)
        circuits = watched_http.get("/ready").json()["backends"]["lm"]["circuits"]
        assert circuits["lm-first"] == "open", circuits
        assert _served_by(_ask(watched_http, "lm-first", stream=False)) == "ref"
    finally:
        lossy.add(lonely)
        lossy.remove(dead)
    assert _ask(watched_http, "lm-only", stream=False).status_code == 200


def test_the_proxy_losing_its_last_node_unreadies_the_gateway_and_answers_503(
    watched_http: httpx.Client, lossy: HarnessProxy, lonely: HarnessNode
) -> None:
    assert watched_http.get("/ready").status_code == 200
    lossy.remove(lonely)
    try:
        assert wait_until(lambda: watched_http.get("/ready").status_code == 503, timeout=30)
        models = watched_http.get("/ready").json()["models"]
        assert models["lm-only"] == {"routable": False, "ready_backends": []}
        assert _proxy_nodes(watched_http, lossy.url) == {"Hybrid": 0, "Prefill": 0, "Decode": 0}
        for stream in (False, True):
            answer = _ask(watched_http, "lm-only", stream=stream)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "server_error" and "Retry-After" in answer.headers
    finally:
        lossy.add(lonely)
    assert wait_until(lambda: watched_http.get("/ready").status_code == 200, timeout=30)


def test_a_proxy_whose_only_node_is_a_prefill_node_is_not_ready(
    watched_http: httpx.Client, watched: RunningGateway, lossy: HarnessProxy, lonely: HarnessNode
) -> None:
    """/v1/models still lists the model; only the proxy's view says no node can serve it without a Decode node."""
    lossy.add(lonely, role=PREFILL)
    try:
        assert wait_until(lambda: watched_http.get("/ready").status_code == 503, timeout=30)
        backend = unwrapped(watched.state.backends["lm"])
        assert isinstance(backend, LMDeployBackend)
        assert backend.pool.nodes[0].reason.startswith("proxy has no node able to serve stub-model (0 Hybrid, 1 Pre")
    finally:
        lossy.add(lonely)
    assert wait_until(lambda: watched_http.get("/ready").status_code == 200, timeout=30)


async def test_a_request_the_proxy_cannot_route_any_more_is_unavailable_not_a_missing_model(
    lossy: HarnessProxy, lonely: HarnessNode
) -> None:
    """Between two health probes the proxy's 404 "model does not exist" means its last node went away."""
    async with running_backend([lossy.url], health_interval=600) as backend:
        assert backend.readiness()[0]
        lossy.remove(lonely)
        try:
            with pytest.raises(UnavailableError, match="has no node serving the model"):
                await collect(backend, chat("Hello"))
        finally:
            lossy.add(lonely)


# DistServe: a proxy with a Prefill and a Decode node (PyTorch backend, stub engine). Prefill runs; the KV
# migration's P-D connection needs RDMA (DLSlime or Mooncake), which the stub engine has not.

PD_NODE_ARGS = ("--model-name", "stub-model", "--session-len", "256", "--backend", "pytorch")


@pytest.fixture(scope="module")
def distserve(harness_dir: Path, model_dir: Path) -> Iterator[tuple[HarnessProxy, HarnessNode, HarnessNode]]:
    workdir = harness_dir / "distserve"
    prefill = make_node(workdir, "prefill", *PD_NODE_ARGS, "--role", "Prefill", model_dir=model_dir)
    decode = make_node(workdir, "decode", *PD_NODE_ARGS, "--role", "Decode", model_dir=model_dir)
    prefill.launch()
    decode.launch()
    proxy = make_proxy(workdir, "--serving-strategy", "DistServe")
    try:
        proxy.start()
        prefill.wait_ready()
        decode.wait_ready()
        proxy.add(prefill, role=PREFILL)
        proxy.add(decode, role=DECODE)
        yield proxy, prefill, decode
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_a_distserve_proxy_is_ready_with_prefill_and_decode_and_its_failures_are_502s(
    distserve: tuple[HarnessProxy, HarnessNode, HarnessNode],
) -> None:
    proxy, prefill, decode = distserve
    running = start_gateway(GatewayConfig(**_single(backend_config([proxy.url], api_key=None))))
    try:
        backend = unwrapped(running.state.backends["lm"])
        assert isinstance(backend, LMDeployBackend)
        assert backend.pool.nodes[0].reason == "proxy with 1 Prefill + 1 Decode node(s) serving stub-model"
        with httpx.Client(base_url=running.base_url, timeout=60) as http:
            body = {"model": PUBLIC_MODEL, "messages": _say("Hello world [[stub tag=pd]]"), "max_tokens": 8}
            answer = http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 502 and answer.json()["error"]["type"] == "server_error", answer.text
            assert _node_errors(http, proxy) == {"server": 1}, "the proxy's plain-text 500 (PDConnection Failure)"
    finally:
        stop_gateway(running)
    (started,) = prefill.events(event="start", tag="pd")
    assert started["max_new_tokens"] == 1, "the proxy's prefill request reached the Prefill node"
    assert not decode.events(event="start", tag="pd"), "no decode without the KV migration's connection"


def _single(lm: dict[str, Any]) -> dict[str, Any]:
    breaker = {"failure_threshold": 1000}
    return {"backends": [lm], "models": [{"name": PUBLIC_MODEL, "backends": ["lm"], "circuit_breaker": breaker}]}

"""The LMDeploy hop of a trace: LMDeploy's real api_server (the harness) receives a ``traceparent`` of the
client's trace, naming the gateway's span of that backend call as its parent, and the spans reach a real OTLP/HTTP
receiver on loopback. The harness notes the trace-context headers of every request it serves in its event log."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway
from ...otlp import OTLPReceiver
from .conftest import PUBLIC_MODEL, backend_config
from .harness.server import HarnessNode


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_lm_gateway(node: HarnessNode, receiver: OTLPReceiver) -> Iterator[RunningGateway]:
    running = start_gateway(
        GatewayConfig(
            server={"tracing": {"endpoint": receiver.endpoint}},
            backends=[backend_config([node.url])],
            models=[{"name": PUBLIC_MODEL, "backends": ["lm"]}],
        )
    )
    yield running
    stop_gateway(running)


@pytest.mark.parametrize("n", [1, 2])
def test_lmdeploy_receives_the_traceparent_of_the_gateways_backend_call(
    traced_lm_gateway: RunningGateway, receiver: OTLPReceiver, node: HarnessNode, n: int
) -> None:
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    response = httpx.post(
        f"{traced_lm_gateway.base_url}/v1/chat/completions",
        json={"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "one two three"}], "n": n},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "caller=1"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert traced_lm_gateway.state.tracing is not None and traced_lm_gateway.state.tracing.flush()
    spans = receiver.spans(trace_id)
    (call,) = (s for s in spans if s.name == f"chat {PUBLIC_MODEL}")
    assert call.kind == "client" and call.attributes["gen_ai.provider.name"] == "lmdeploy"
    assert call.attributes["gateway.lmdeploy.node"] == node.url
    assert call.attributes["gen_ai.usage.output_tokens"] == response.json()["usage"]["completion_tokens"]
    received = [e for e in node.events(event="http", path="/v1/chat/completions") if trace_id in e["traceparent"]]
    assert len(received) == n, "each choice's upstream request carries it"
    for event in received:
        assert event["traceparent"] == f"00-{trace_id}-{call.span_id}-01"
        assert event["tracestate"] == "caller=1"


def test_an_untraced_request_sends_lmdeploy_no_trace_context(
    traced_lm_gateway: RunningGateway, node: HarnessNode
) -> None:
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    seen = len(node.events(event="http"))
    response = httpx.post(
        f"{traced_lm_gateway.base_url}/v1/chat/completions",
        json={"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "one"}]},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-00"},  # the caller sampled it out
        timeout=60,
    )
    assert response.status_code == 200
    assert len(node.events(event="http")) == seen

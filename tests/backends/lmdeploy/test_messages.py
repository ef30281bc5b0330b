"""``/v1/messages`` on the LMDeploy backend, through LMDeploy's real api_server (stub engine that echoes the last user
turn): a streamed message with thinking, a forced tool call, token counting and pings, with the anthropic SDK and
every body and event checked against its types."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from gateway.server_config import ApiKeyConfig

from ...anthropic_conformance import ConformingTransport, checked_stream
from ...budget_client import charged
from ...conftest import RunningGateway, start_gateway, stop_gateway
from .conftest import PUBLIC_MODEL, gateway_config
from .harness.server import HarnessNode

WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def conforming() -> ConformingTransport:
    return ConformingTransport()


@pytest.fixture(scope="module")
def claude(lm_gateway: RunningGateway, conforming: ConformingTransport) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=lm_gateway.base_url, api_key="unused", max_retries=0, http_client=httpx2.Client(transport=conforming)
    )


def test_a_streamed_message_thinks_then_answers_and_counts_its_prompt(
    claude: anthropic.Anthropic, conforming: ConformingTransport
) -> None:
    said = [{"role": "user", "content": "Need a word</think>Hello world! How are you"}]
    streams = conforming.counts["streams"]
    with claude.messages.stream(model=PUBLIC_MODEL, max_tokens=64, thinking={"type": "adaptive"}, messages=said) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert conforming.counts["streams"] == streams + 1
    assert "thinking" in kinds and "signature" in kinds and "text" in kinds
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Need a word" and thinking.signature
    assert text.type == "text" and text.text == "Hello world! How are you"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    counted = claude.messages.count_tokens(model=PUBLIC_MODEL, thinking={"type": "adaptive"}, messages=said)
    assert counted.input_tokens == final.usage.input_tokens, "LMDeploy counts by generating one token"


@pytest.fixture(scope="module")
def counting_gateway(node: HarnessNode) -> Iterator[RunningGateway]:
    """The shared node behind a key with a token budget, whose charges the tests read."""
    config = gateway_config([node.url], failure_threshold=1000)
    config.server.auth.api_keys = [ApiKeyConfig(key="sk-counting-key", name="counting", tokens_per_minute=100_000)]
    config.server.auth.public_metrics = True
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def _counted_and_charged(gateway: RunningGateway, **body: Any) -> tuple[int, float]:
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key="sk-counting-key", max_retries=0)
    before = charged(gateway, "counting")
    counted = client.messages.count_tokens(model=PUBLIC_MODEL, **body).input_tokens
    return counted, charged(gateway, "counting") - before


def test_a_plain_conversation_is_counted_by_the_node_without_generating(
    counting_gateway: RunningGateway, node: HarnessNode
) -> None:
    said = [{"role": "user", "content": "Hi there [[stub tag=count-plain]]"}]
    counted, cost = _counted_and_charged(counting_gateway, messages=said)
    assert not node.events(event="start", tag="count-plain"), "no engine request"
    assert cost == 0
    client = anthropic.Anthropic(base_url=counting_gateway.base_url, api_key="sk-counting-key", max_retries=0)
    assert client.messages.create(model=PUBLIC_MODEL, max_tokens=8, messages=said).usage.input_tokens == counted


def test_a_count_with_tools_generates_one_token_and_is_charged_for_it(
    counting_gateway: RunningGateway, node: HarnessNode
) -> None:
    """The node's own count leaves the tools out: the exact count runs the prompt for one token, real work the key
    pays for like a request."""
    said = [{"role": "user", "content": "Weather? [[stub tag=count-tools]]"}]
    counted, cost = _counted_and_charged(counting_gateway, messages=said, tools=[WEATHER])
    assert node.events(event="start", tag="count-tools")
    assert cost == counted + 1


def test_a_forced_tool_call_comes_back_as_a_tool_use_block(claude: anthropic.Anthropic) -> None:
    """LMDeploy does not constrain a forced call: the stub writes it (qwen3's markup), the node's parser reads it."""
    call = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    message = claude.messages.create(
        model=PUBLIC_MODEL,
        max_tokens=128,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": call}],
    )
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.type == "text" and text.text == "Sure."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")


def test_a_stream_that_goes_quiet_gets_ping_events(node: HarnessNode) -> None:
    """The upstream pauses after its first token for 20 ping intervals; the pause ends the wait, not a clock."""
    config = gateway_config([node.url])
    config.server.streams.ping_seconds = 0.05
    running = start_gateway(config)
    body = {
        "model": PUBLIC_MODEL,
        "max_tokens": 32,
        "stream": True,
        "messages": [{"role": "user", "content": "one two three [[stub pause=1 pause_after=1 tag=quiet-messages]]"}],
    }
    try:
        with httpx.stream("POST", f"{running.base_url}/v1/messages", json=body, timeout=30) as response:
            events = checked_stream(list(response.iter_lines()))
    finally:
        stop_gateway(running)
    kinds = [event["type"] for event in events]
    first_delta = kinds.index("content_block_delta")
    assert "ping" in kinds[first_delta:], "no ping while the upstream was quiet"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text.startswith("one two three") and kinds[-1] == "message_stop"

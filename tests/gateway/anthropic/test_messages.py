"""``/v1/messages`` with the real anthropic SDK against a real gateway on the reference engine: create and stream
(text, thinking, tool use), replay of thinking and tool blocks, count_tokens, stop reasons, errors, keys and budgets.
Every body and event the SDK receives is checked against the SDK's own types (``ConformingTransport``)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import GatewayConfig

from ...anthropic_conformance import ConformingTransport, check_error, checked_stream
from ...conftest import MODEL, TINY_CONTEXT, TINY_MODEL, RunningGateway, start_gateway, stop_gateway, wait_until
from .conftest import ALIASES, KEY, LIMITED_KEY, LIMITED_REQUESTS, SMALL_CONTEXT, SMALL_MODEL

HI = [{"role": "user", "content": "Hi"}]
CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
ANSWER = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
GREEDY = {"temperature": 0}  # the SDK's create() has no temperature argument any more: sent as an extra field
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CLOCK = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}},
}
LONG_TEXT = {  # a forced call to it cannot end before 3000 characters: the output runs until max_tokens or the context
    "name": "write",
    "input_schema": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 3000}},
        "required": ["text"],
    },
}


def test_create_returns_a_conforming_message_whose_input_tokens_count_tokens_predicts(
    claude: anthropic.Anthropic, conforming: ConformingTransport
) -> None:
    bodies = conforming.counts["bodies"]
    message = claude.messages.create(model=ALIASES[0], max_tokens=24, messages=HI)
    assert message.model == MODEL, "an alias is the model it stands for"
    assert message.role == "assistant" and message.type == "message"
    assert [block.type for block in message.content] == ["text"] and message.content[0].text  # type: ignore[union-attr]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 24
    counted = claude.messages.count_tokens(model=ALIASES[0], messages=HI)
    assert counted.input_tokens == message.usage.input_tokens
    assert conforming.counts["bodies"] == bodies + 2


def test_stream_events_follow_anthropics_sequence_and_rebuild_the_message(
    claude: anthropic.Anthropic, conforming: ConformingTransport
) -> None:
    streams = conforming.counts["streams"]
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert conforming.counts["streams"] == streams + 1, "the whole stream went through the event checks"
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.input_tokens == claude.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens <= 24


def test_greedy_replies_stop_at_max_tokens_and_at_stop_sequences_which_are_named(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=64, messages=HI, extra_body=GREEDY)
    text = whole.content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert whole.usage.output_tokens > 3 and len(words) >= 3, text
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=HI, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert text.startswith(cut.content[0].text)  # type: ignore[union-attr]
    stop = " " + words[2]
    stopped = claude.messages.create(
        model=MODEL, max_tokens=64, stop_sequences=["never-written", stop], messages=HI, extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with claude.messages.stream(
        model=MODEL, max_tokens=64, stop_sequences=[stop], messages=HI, extra_body=GREEDY
    ) as stream:
        assert "".join(stream.text_stream) == text[: text.index(stop)]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_thinking_comes_as_a_signed_block_that_replays_and_a_tampered_one_is_refused(
    claude: anthropic.Anthropic,
) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=64, thinking={"type": "adaptive"}, output_config={"effort": "max"}, messages=HI
    )
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert message.usage.output_tokens_details is not None and message.usage.output_tokens_details.thinking_tokens > 0
    history: list[Any] = [*HI, {"role": "assistant", "content": message.content}, {"role": "user", "content": "More"}]
    again = claude.messages.create(model=MODEL, max_tokens=8, thinking={"type": "adaptive"}, messages=history)
    assert again.content
    tampered = thinking.model_dump()
    tampered["thinking"] += " (edited)"
    history[1] = {"role": "assistant", "content": [tampered, *message.content[1:]]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=8, messages=history)
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "signature" in refused.value.body["error"]["message"]  # type: ignore[index]


def test_effort_and_budget_reach_v41s_prompt_only_in_thinking_mode(
    claude: anthropic.Anthropic, raw: httpx.Client
) -> None:
    def count(**fields: Any) -> int:
        return claude.messages.count_tokens(model=MODEL, messages=HI, **fields).input_tokens

    def chat_prompt(effort: str) -> tuple[int, str]:
        """The chat route's prompt for the same turn at ``effort``: its length and its text."""
        tokens = raw.post("/tokenize", json={"model": MODEL, "messages": HI, "reasoning_effort": effort}).json()
        text = raw.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
        return tokens["count"], text

    chat = count()
    assert count(thinking={"type": "disabled"}) == chat
    assert count(output_config={"effort": "max"}) == chat, "effort alone does not switch thinking on"
    thinking = count(thinking={"type": "adaptive"})
    assert thinking > chat, "thinking mode prints the effort at the top of the prompt"
    assert count(thinking={"type": "enabled", "budget_tokens": 2048}) == thinking
    assert count(thinking={"type": "enabled"}) == thinking, "DeepSeek's form: enabled without budget_tokens"
    default_length, default_text = chat_prompt("high")
    assert "Reasoning Effort: 75 " in default_text and thinking == default_length, "V4.1's default effort, 75"
    low_length, low_text = chat_prompt("low")
    assert "Reasoning Effort: 50 " in low_text
    assert count(thinking={"type": "adaptive"}, output_config={"effort": "low"}) == low_length


def test_omitted_thinking_is_signed_and_replays_its_reasoning(claude: anthropic.Anthropic, raw: httpx.Client) -> None:
    """``display: omitted`` sends no thinking text, only a signature that gives the model its reasoning back."""
    # Greedy by top_k 1: thinking mode samples at temperature 1.0 whatever the request says, as DeepSeek does.
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 48, "messages": HI, "tools": [WEATHER]}
    greedy = {"top_k": 1}  # the SDK's create() takes it as an extra field too
    shown = claude.messages.create(**asked, thinking={"type": "adaptive"}, extra_body=greedy)
    omitted = claude.messages.create(**asked, thinking={"type": "adaptive", "display": "omitted"}, extra_body=greedy)
    assert shown.content[0].thinking, "greedy decoding: both requests reason alike"  # type: ignore[union-attr]
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""  # type: ignore[union-attr]
    streamed = {**asked, **greedy, "stream": True, "thinking": {"type": "adaptive", "display": "omitted"}}
    with raw.stream("POST", "/v1/messages", json=streamed) as response:
        events = checked_stream(list(response.iter_lines()))
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert deltas == ["signature_delta"], "no thinking text is streamed"

    def replayed(block: Any) -> int:  # in thinking mode with tools, V4.1 keeps earlier reasoning in the prompt
        history = [*HI, {"role": "assistant", "content": [block]}, {"role": "user", "content": "More"}]
        thinking: Any = {"type": "adaptive"}
        return claude.messages.count_tokens(
            model=MODEL, messages=history, tools=[WEATHER], thinking=thinking
        ).input_tokens

    with_reasoning = replayed(shown.content[0])
    assert replayed(omitted.content[0]) == with_reasoning
    assert replayed({"type": "redacted_thinking", "data": "opaque"}) < with_reasoning


def test_a_forced_tool_call_is_a_tool_use_block_and_its_result_continues_the_turn(
    claude: anthropic.Anthropic,
) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=256,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert uses[0].input["city"] in ("Oslo", "Paris")  # type: ignore[index]
    history: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]},
    ]
    reply = claude.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER, CLOCK], messages=history)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")

    def counted(is_error: bool) -> int:
        result = {
            "type": "tool_result",
            "tool_use_id": uses[0].id,
            "is_error": is_error,
            "content": [{"type": "text", "text": "down"}],
        }
        answered = [*history[:2], {"role": "user", "content": [result]}]
        return claude.messages.count_tokens(model=MODEL, tools=[WEATHER, CLOCK], messages=answered).input_tokens

    assert counted(True) > counted(False), "an error result reaches the prompt marked as one"


def test_a_streamed_tool_call_sends_its_input_as_json_deltas(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=256,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather or time?"}],
    ) as stream:
        partial = "".join(e.partial_json for e in stream if e.type == "input_json")
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and {u.name for u in uses} <= {"get_weather", "get_time"}
    assert partial, "the input came as input_json_delta events"
    whole = claude.messages.count_tokens(
        model=MODEL, tools=[WEATHER, CLOCK], messages=[{"role": "user", "content": "Weather or time?"}]
    )
    assert final.usage.input_tokens == whole.input_tokens


def test_count_tokens_is_the_input_tokens_of_a_whole_conversation(claude: anthropic.Anthropic) -> None:
    """System blocks, tools, a role-system message, thinking replayed and a tool turn: one count, both routes."""
    first = claude.messages.create(
        model=MODEL,
        max_tokens=128,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    use = next(b for b in first.content if b.type == "tool_use")
    conversation: dict[str, Any] = {
        "model": ALIASES[1],
        "system": [
            {"type": "text", "text": "You are brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer in English."},
        ],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "rain"},
                    {"type": "text", "text": "And?"},
                ],
            },
            {"role": "system", "content": "Keep it short."},
            {"role": "user", "content": "Thanks"},
        ],
    }
    counted = claude.messages.count_tokens(**conversation, thinking={"type": "adaptive"})
    created = claude.messages.create(**conversation, max_tokens=8, thinking={"type": "adaptive"})
    assert counted.input_tokens == created.usage.input_tokens


def test_a_prompt_that_leaves_too_little_room_is_cut_at_the_contexts_end(
    claude: anthropic.Anthropic, messages_gateway: RunningGateway
) -> None:
    """Claude Code asks for 32000 tokens whatever the context: the output ends where the context does."""
    message = claude.messages.create(
        model=SMALL_MODEL,
        max_tokens=32000,
        tools=[LONG_TEXT],
        tool_choice={"type": "tool", "name": "write"},
        messages=[{"role": "user", "content": "Write."}],
    )
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.input_tokens + message.usage.output_tokens == SMALL_CONTEXT
    uncut = claude.messages.create(
        model=SMALL_MODEL,
        max_tokens=8,
        tools=[LONG_TEXT],
        tool_choice={"type": "tool", "name": "write"},
        messages=[{"role": "user", "content": "Write."}],
    )
    assert uncut.stop_reason == "max_tokens" and uncut.usage.output_tokens == 8


def test_a_prompt_longer_than_the_context_is_a_400_saying_prompt_is_too_long(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=TINY_MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * TINY_CONTEXT}]
        )
    assert refused.value.body["error"]["message"].startswith("prompt is too long: ")  # type: ignore[index]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"top_k": 1.5}, "top_k"),
        ({"temperature": 1.5}, "temperature"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            "messages[0].content[0]",  # an image URL: not fetched (base64 only)
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": "red"}]}]},
            "messages[0].content[0].colour",
        ),
        ({"messages": [*HI, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
        ({"messages": [*HI, CALLED, {"role": "user", "content": "And?"}]}, "messages[1].content[0]': tool_use id"),
        (
            {"messages": [*HI, CALLED, {"role": "user", "content": [{"type": "text", "text": "x"}, ANSWER]}]},
            "come first",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema.type"),
        ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget_tokens"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"stop_sequences": ["  "]}, "stop_sequences[0]"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0].type"),
        ({"mcp_servers": [{"type": "url", "url": "https://example.invalid", "name": "m"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
        ({"speed": "fast"}, "speed"),
        ({"metadata": {"user_id": "u", "tier": "gold"}}, "metadata.tier"),
    ],
)
def test_bad_requests_are_anthropic_400s_naming_the_field(
    raw: httpx.Client, change: dict[str, Any], words: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": HI, **change}
    body = {k: v for k, v in body.items() if v is not None}
    response = raw.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = check_error(response.json()).error
    assert error.type == "invalid_request_error" and words in error.message, error.message
    assert response.json()["request_id"] == response.headers["x-request-id"]


def test_unknown_models_keys_and_spent_budgets_are_anthropic_errors_the_sdk_raises(
    messages_gateway: RunningGateway, conforming: ConformingTransport
) -> None:
    def sdk(**options: Any) -> anthropic.Anthropic:
        import httpx2

        return anthropic.Anthropic(
            base_url=messages_gateway.base_url,
            max_retries=0,
            http_client=httpx2.Client(transport=conforming),
            **options,
        )

    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk(api_key=KEY).messages.create(model="claude-opus-9", max_tokens=8, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        sdk(api_key="sk-not-a-key-000").messages.create(model=MODEL, max_tokens=8, messages=HI)
    with pytest.raises(anthropic.AuthenticationError):
        sdk(api_key=None, auth_token="sk-not-a-key-000").messages.count_tokens(model=MODEL, messages=HI)
    assert sdk(api_key=None, auth_token=KEY).messages.create(model=MODEL, max_tokens=4, messages=HI).content
    # One budget per key, whichever API spends it: chat first, then messages.
    chat = openai.OpenAI(base_url=f"{messages_gateway.base_url}/v1", api_key=LIMITED_KEY, max_retries=0)
    chat.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    limited = sdk(api_key=LIMITED_KEY)
    for _ in range(LIMITED_REQUESTS - 1):
        limited.messages.create(model=MODEL, max_tokens=4, messages=HI)
    with pytest.raises(anthropic.RateLimitError) as spent:
        limited.messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert spent.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(spent.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        chat.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])


def test_aliases_serve_openai_clients_and_are_listed(messages_gateway: RunningGateway) -> None:
    client = openai.OpenAI(base_url=f"{messages_gateway.base_url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=ALIASES[1], max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert reply.model == MODEL
    listed = {m.id: m.model_extra for m in client.models.list()}
    assert set(ALIASES) <= listed.keys() and listed[MODEL]["aliases"] == list(ALIASES)  # type: ignore[index]
    assert listed[ALIASES[0]]["alias_of"] == MODEL  # type: ignore[index]
    assert client.models.retrieve(ALIASES[1]).model_extra["alias_of"] == MODEL  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("claude-opus-9")


def test_messages_are_counted_by_served_model_and_backend(
    claude: anthropic.Anthropic, messages_gateway: RunningGateway
) -> None:
    labels = {"model": MODEL, "backend": "reference", "status": "200"}
    before = messages_gateway.metric("gateway_requests_total", **labels)
    claude.messages.create(model=ALIASES[0], max_tokens=4, messages=HI)
    with claude.messages.stream(model=ALIASES[1], max_tokens=4, messages=HI) as stream:
        stream.until_done()
    assert messages_gateway.metric("gateway_requests_total", **labels) == before + 2


def test_a_client_that_leaves_mid_stream_aborts_the_engine_request(timed_gateway: RunningGateway) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "stream": True,
        "tools": [LONG_TEXT],
        "tool_choice": {"type": "tool", "name": "write"},
        "messages": [{"role": "user", "content": "Write."}],
    }
    before = timed_gateway.metric("gateway_requests_total", model=MODEL, status="499")
    with (
        httpx.Client(base_url=timed_gateway.base_url, timeout=30) as client,
        client.stream("POST", "/v1/messages", json=body) as response,
    ):
        lines = response.iter_lines()  # kept: dropping the iterator would close the connection at once
        assert next(line for line in lines if line.startswith("data: "))
        assert timed_gateway.driver_in_flight() == 1
    assert wait_until(timed_gateway.engine_idle)
    assert wait_until(lambda: timed_gateway.metric("gateway_requests_total", model=MODEL, status="499") == before + 1)


def test_a_stream_past_its_deadline_ends_with_an_error_event() -> None:
    config = GatewayConfig(
        server={"streams": {"request_timeout": 1.0}},
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "stream": True,
        "tools": [LONG_TEXT],
        "tool_choice": {"type": "tool", "name": "write"},
        "messages": [{"role": "user", "content": "Write."}],
    }
    try:
        with httpx.stream("POST", f"{running.base_url}/v1/messages", json=body, timeout=30) as response:
            assert response.status_code == 200
            events = checked_stream(list(response.iter_lines()))
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
        assert events[-1]["error"]["type"] == "timeout_error" and "timed out" in events[-1]["error"]["message"]
        assert any(e["type"] == "content_block_start" for e in events), "output flowed before the deadline"
        assert wait_until(running.engine_idle)
    finally:
        stop_gateway(running)

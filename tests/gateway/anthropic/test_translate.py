"""A Messages request as the chat request every backend serves: messages, tools, tool choice, thinking."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.anthropic.protocol import MessagesRequest
from gateway.anthropic.signatures import ThinkingSigner
from gateway.anthropic.translate import chat_messages, chat_tool_choice, chat_tools, generate_request, thinking_mode
from gateway.errors import APIError

SIGNER = ThinkingSigner.from_secret("translation tests secret")
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}}}


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, **fields})


def test_turns_become_chat_messages_in_order() -> None:
    thought = SIGNER.sign("I should check.")
    body = request(
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be kind."},
        ],
        messages=[
            {"role": "user", "content": "Weather in Oslo and Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "I should check.", "signature": thought}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_b",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}],
                    },
                    {"type": "text", "text": "So?"},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Answer now."}]},
            {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]},
        ],
    )
    assert chat_messages(body, SIGNER) == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather in Oslo and Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "I should check.",
            "tool_calls": [
                {
                    "id": "toolu_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "toolu_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "Error: no\n\ndata"},
        {"role": "user", "content": "So?"},
        {"role": "system", "content": "Answer now."},
        {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]},
    ]


def test_a_thinking_block_signed_elsewhere_is_refused_naming_it() -> None:
    body = request(
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "EqQBCkYIBxgCKkD"}]},
            {"role": "user", "content": "Hi"},
        ]
    )
    with pytest.raises(APIError) as refused:
        chat_messages(body, SIGNER)
    assert refused.value.status == 400 and refused.value.param == "messages[1].content[0].signature"


def test_clear_thinking_keeps_the_reasoning_of_the_latest_turns_only() -> None:
    def turn(text: str) -> list[dict[str, Any]]:
        block = {"type": "thinking", "thinking": text, "signature": SIGNER.sign(text)}
        return [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [block, {"type": "text", "text": text}]},
        ]

    conversation = [*turn("one"), *turn("two"), *turn("three"), {"role": "user", "content": "Go"}]
    kept = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]}
    reasoning = [
        m.get("reasoning_content")
        for m in chat_messages(request(messages=conversation, context_management=kept), SIGNER)
        if m["role"] == "assistant"
    ]
    assert reasoning == [None, "two", "three"]
    everything = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    reasoning = [
        m.get("reasoning_content")
        for m in chat_messages(request(messages=conversation, context_management=everything), SIGNER)
        if m["role"] == "assistant"
    ]
    assert reasoning == ["one", "two", "three"]


@pytest.mark.parametrize(
    ("choice", "chat", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, None),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice_maps_onto_chats(choice: dict[str, Any], chat: Any, parallel: bool | None) -> None:
    body = request(messages=[{"role": "user", "content": "Hi"}], tools=[TOOL], tool_choice=choice)
    assert chat_tool_choice(body) == (chat, parallel)


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, (None, None)),
        ({"output_config": {"effort": "max"}}, (None, None)),
        ({"thinking": {"type": "disabled"}, "output_config": {"effort": "max"}}, (False, None)),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, (True, None)),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "xhigh"}},
            (True, "xhigh"),
        ),
        ({"thinking": {"type": "between_tools"}, "output_config": {"effort": "low"}}, (True, "low")),
    ],
)
def test_thinking_and_effort_become_the_chat_requests_thinking_mode(
    fields: dict[str, Any], mode: tuple[Any, Any]
) -> None:
    assert thinking_mode(request(messages=[{"role": "user", "content": "Hi"}], **fields)) == mode


def test_sampling_stop_sequences_user_and_format_reach_the_chat_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = request(
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0.5,
        top_k=5,
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    chat = generate_request(body, request_id="r", model="served", signer=SIGNER, max_buffered_tokens=None)
    assert chat.model == "served" and chat.user == "u-1"
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.sampling.top_k) == (16, 0.5, 5)
    assert chat.sampling.stop == ["END"] and chat.sampling.fit_context
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_a_deferred_tool_reaches_the_prompt_once_a_tool_reference_loads_it() -> None:
    deferred = {"name": "get_time", "input_schema": {"type": "object"}, "defer_loading": True}
    search = {"name": "search_tools", "input_schema": {"type": "object"}}
    asked = [{"role": "user", "content": "What time is it?"}]
    before = request(messages=asked, tools=[search, deferred])
    assert [t["function"]["name"] for t in chat_tools(before) or ()] == ["search_tools"]
    found = [
        *asked,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "search_tools", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_s",
                    "content": [{"type": "tool_reference", "tool_name": "get_time"}],
                }
            ],
        },
    ]
    after = request(messages=found, tools=[search, deferred])
    assert [t["function"]["name"] for t in chat_tools(after) or ()] == ["search_tools", "get_time"]
    assert chat_messages(after, SIGNER)[-1] == {
        "role": "tool",
        "tool_call_id": "toolu_s",
        "content": "Tool loaded: get_time",
    }
    with pytest.raises(ValidationError, match="not in tools"):
        request(messages=found, tools=[search])

"""Responses input items as chat messages: one assistant turn from its reasoning, text and calls, in order."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.openai.parameters import UnsupportedParameter
from gateway.responses.protocol import CreateResponseRequest, chat_messages


def _items(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return CreateResponseRequest(model="m", input=raw).items


def test_an_assistant_turn_folds_reasoning_text_and_calls_into_one_message() -> None:
    items = _items(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "two"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "call_b", "name": "weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "message", "role": "assistant", "content": "Sunny, then rain."},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
        ]
    )
    assert chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "two",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "assistant", "content": "Sunny, then rain."},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_second_assistant_message_starts_a_new_turn() -> None:
    items = _items(
        [
            {"role": "assistant", "content": "One."},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
            {"role": "assistant", "content": "Two."},
        ]
    )
    assert chat_messages(None, items) == [
        {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": "Two.", "reasoning_content": "hm"},
    ]


def test_items_get_ids_and_keep_the_ones_they_have() -> None:
    items = _items([{"role": "user", "content": "hi", "id": "msg_mine"}, {"role": "user", "content": "again"}])
    assert items[0]["id"] == "msg_mine"
    assert items[1]["id"].startswith("msg_") and items[1]["id"] != "msg_mine"
    assert items[1]["content"] == [{"type": "input_text", "text": "again"}]


def test_a_string_input_is_one_user_message() -> None:
    request = CreateResponseRequest(model="m", input="hello")
    assert chat_messages(None, request.items) == [{"role": "user", "content": "hello"}]


def test_a_bad_item_names_its_field() -> None:
    with pytest.raises(ValueError) as caught:
        CreateResponseRequest(
            model="m", input=[{"role": "user", "content": "a"}, {"type": "function_call", "name": "f"}]
        )
    error = caught.value.errors()[0]["ctx"]["error"]  # type: ignore[attr-defined]
    assert isinstance(error, UnsupportedParameter) and error.where == "[1].call_id"

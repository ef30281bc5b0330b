"""DeepSeek V4.1 on the OpenAI API, end to end on the reference engine with the official SDK: thinking mode and
``reasoning_content``, tools in and tool calls out (forced with constrained decoding, since the tiny model never
calls a tool by itself), structured outputs, seeds, and the 400s for bad requests. Bodies and stream chunks are
checked against OpenAI's schemas."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any, Literal

import deepseek_recipe as recipe
import httpx
import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import EngineBackend
from backends.reference import ReferenceEngine, ReferenceEngineArgs, load_or_build
from gateway.config import GatewayConfig

from ..conformance import OpenAISchemas
from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway

QUESTION = [{"role": "user", "content": "Tell me about files."}]
MODE_TOOL = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "description": "Switch the mode",
        "parameters": {
            "type": "object",
            "properties": {"mode": {"enum": ["fast", "safe"]}, "on": {"type": "boolean"}},
            "required": ["mode", "on"],
        },
    },
}
DEEP: dict[str, Any] = {"type": "integer"}
for _ in range(200):  # 400 levels of JSON nesting: far past any model's (and the limit of 64 levels)
    DEEP = {"type": "object", "properties": {"a": DEEP}}
PING_TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
SET_MODE = {"type": "function", "function": {"name": "set_mode"}}
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green"]},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["ok", "color", "note"],
}


def chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 300, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 300, "stream": True, **fields}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


def reasoned_answer(http: httpx.Client, **fields: Any) -> tuple[int, dict[str, Any]]:
    """A seed whose thinking-mode reply closes its reasoning and answers within max_tokens, and that reply."""
    for seed in range(12):
        body = chat(http, seed=seed, **fields)
        message = body["choices"][0]["message"]
        if body["choices"][0]["finish_reason"] == "stop" and message.get("reasoning_content") and message["content"]:
            return seed, body
    raise AssertionError("no seed in 0-11 gave reasoning and an answer within 300 tokens")


# ---- thinking ----------------------------------------------------------------------------------------------


def test_chat_mode_reply_has_no_reasoning_content(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = chat(http, seed=3)
    schemas.check("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_reasoning_effort_turns_thinking_on_with_reasoning_content(http: httpx.Client, schemas: OpenAISchemas) -> None:
    _, body = reasoned_answer(http, reasoning_effort="high")
    schemas.check("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert "<think>" not in message["content"] and "</think>" not in message["reasoning_content"]
    usage = body["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]


@pytest.mark.parametrize(
    "fields",
    [{"chat_template_kwargs": {"thinking": True}}, {"chat_template_kwargs": {"enable_thinking": True}}],
    ids=["thinking", "enable_thinking"],
)
def test_chat_template_kwargs_turn_thinking_on(http: httpx.Client, fields: dict[str, Any]) -> None:
    _, body = reasoned_answer(http, **fields)
    assert body["choices"][0]["message"]["reasoning_content"]


@pytest.fixture(scope="module")
def thinking_by_default() -> Iterator[httpx.Client]:
    """A gateway whose reference backend has ``default_thinking: true`` (the chat template's switch)."""
    backend = EngineBackend(
        "thinker",
        "reference",
        lambda: ReferenceEngine.from_engine_args(ReferenceEngineArgs()),
        DeepSeekV41ChatTemplate(default_thinking=True),
    )
    config = GatewayConfig(
        backends=[{"name": "thinker", "kind": "reference", "default_thinking": True}],
        models=[{"name": MODEL, "backends": ["thinker"]}],
    )
    running = start_gateway(config, backends={"thinker": backend})
    with httpx.Client(base_url=running.base_url, timeout=60) as client:
        yield client
    stop_gateway(running)


def test_backend_defaulting_to_thinking_reasons_unless_the_request_says_otherwise(
    thinking_by_default: httpx.Client,
) -> None:
    _, body = reasoned_answer(thinking_by_default)
    assert body["choices"][0]["message"]["reasoning_content"]
    for fields in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}}):
        message = chat(thinking_by_default, seed=0, **fields)["choices"][0]["message"]
        assert "reasoning_content" not in message, fields


def test_reasoning_effort_none_means_chat_mode(http: httpx.Client) -> None:
    for seed in range(3):
        message = chat(http, seed=seed, reasoning_effort="none", chat_template_kwargs={"thinking": True})["choices"][0]
        assert "reasoning_content" not in message["message"]


def test_streamed_thinking_sends_reasoning_deltas_then_content_and_matches_the_whole_reply(
    http: httpx.Client, schemas: OpenAISchemas
) -> None:
    seed, whole = reasoned_answer(http, reasoning_effort="low")
    chunks = stream_chunks(http, seed=seed, reasoning_effort="low", stream_options={"include_usage": True})
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["reasoning_content"], "the first frame carries reasoning"
    kinds = [
        "reasoning" if d.get("reasoning_content") else "content"
        for d in deltas
        if d.get("content") or d.get("reasoning_content")
    ]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "all reasoning comes before the answer"
    message = whole["choices"][0]["message"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


def test_sdk_reads_reasoning_content_and_same_seed_gives_same_reply(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": QUESTION, "max_tokens": 120, "seed": 21, "reasoning_effort": "high"}
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    reasoning = first.choices[0].message.model_extra.get("reasoning_content")  # type: ignore[union-attr]
    assert reasoning
    assert second.choices[0].message.model_extra.get("reasoning_content") == reasoning  # type: ignore[union-attr]
    assert second.choices[0].message.content == first.choices[0].message.content
    assert first.system_fingerprint is not None and first.system_fingerprint.startswith("fp_reference-")


# ---- tools -------------------------------------------------------------------------------------------------


def test_tools_are_rendered_into_the_prompt(http: httpx.Client) -> None:
    plain = chat(http, max_tokens=1)["usage"]["prompt_tokens"]
    with_tools = chat(http, max_tokens=1, tools=[MODE_TOOL])["usage"]["prompt_tokens"]
    without = chat(http, max_tokens=1, tools=[MODE_TOOL], tool_choice="none")["usage"]["prompt_tokens"]
    assert with_tools > plain + 100 and without == plain


def test_auto_tool_choice_with_no_call_is_an_ordinary_reply(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = chat(http, seed=2, max_tokens=40, tools=[MODE_TOOL])
    schemas.check("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")


def test_named_tool_choice_returns_that_call_with_valid_arguments(client: openai.OpenAI, http: httpx.Client) -> None:
    args = {"model": MODEL, "messages": QUESTION, "max_tokens": 300, "seed": 4, "tools": [MODE_TOOL, PING_TOOL]}
    reply = client.chat.completions.create(**args, tool_choice=SET_MODE)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "set_mode"
    arguments = json.loads(call.function.arguments)
    assert arguments["mode"] in ("fast", "safe") and isinstance(arguments["on"], bool)


def test_required_tool_choice_in_thinking_mode_reasons_then_calls(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = chat(http, seed=1, tools=[MODE_TOOL, PING_TOOL], tool_choice="required", reasoning_effort="high")
    schemas.check("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"]
    names = [call["function"]["name"] for call in choice["message"]["tool_calls"]]
    assert names and set(names) <= {"set_mode", "ping"}
    for call in choice["message"]["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_streamed_tool_call_chunks_conform_and_rebuild_the_call(http: httpx.Client, schemas: OpenAISchemas) -> None:
    fields = {"seed": 4, "tools": [MODE_TOOL, PING_TOOL], "tool_choice": SET_MODE}
    chunks = stream_chunks(http, **fields)
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert pieces[0]["index"] == 0 and pieces[0]["type"] == "function" and pieces[0]["id"].startswith("call_")
    assert pieces[0]["function"]["name"] == "set_mode"
    assert all(p["index"] == 0 and "id" not in p for p in pieces[1:])
    arguments = "".join(p["function"].get("arguments", "") for p in pieces)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = chat(http, **fields)["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(arguments) == json.loads(whole["function"]["arguments"])


def test_sdk_streams_tool_call_deltas_by_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=300,
        seed=4,
        tools=[MODE_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.function and delta.function.name:
                entry["name"] += delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert all(
        c["name"] == "set_mode" and json.loads(c["arguments"])["mode"] in ("fast", "safe") for c in calls.values()
    )


class Unit(StrEnum):
    C = "c"
    F = "f"


class Place(BaseModel):
    city: str = Field(max_length=10)
    unit: Unit
    zoom: int = Field(ge=1, le=20)


class Trip(BaseModel):
    """A nested Pydantic tool schema: ``$ref``/``$defs``, ``anyOf`` with null, enums, bounded numbers and text."""

    dest: Place
    via: Place | None = None
    score: float = Field(ge=1, le=5)
    mode: Literal["fast", "safe"]
    label: str = Field(max_length=6)


TRIP_TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}}
PLAN_TRIP = {"type": "function", "function": {"name": "plan_trip"}}


@pytest.mark.parametrize("seed", range(6))
def test_forced_call_arguments_validate_against_a_nested_pydantic_schema(client: openai.OpenAI, seed: int) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=400,
        seed=seed,
        tools=[TRIP_TOOL, MODE_TOOL],  # type: ignore[list-item]
        tool_choice=PLAN_TRIP,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "plan_trip"
    Trip.model_validate_json(call.function.arguments)  # raises on any violation of the schema


TICKET_TOOL = {
    "type": "function",
    "function": {
        "name": "open_ticket",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "day": {"type": "string", "format": "date"},
                "tag": {"type": "string", "pattern": "^#[a-z]{2,5}$"},
            },
            "required": ["code", "day", "tag"],
        },
    },
}


@pytest.mark.parametrize("seed", range(4))
def test_forced_call_arguments_match_the_pattern_and_format_of_their_parameters(
    client: openai.OpenAI, seed: int
) -> None:
    """Before, ``pattern`` and ``format`` were not compiled: the value ran free until max_tokens and the call came
    back as ``{}``."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=200,
        seed=seed,
        tools=[TICKET_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "open_ticket"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", arguments["code"]), arguments
    assert re.fullmatch(r"#[a-z]{2,5}", arguments["tag"]), arguments
    datetime.date.fromisoformat(arguments["day"])  # RFC 3339 full-date; raises otherwise


def test_sdk_parse_helper_reads_a_forced_call_into_the_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=400,
        seed=7,
        tools=[openai.pydantic_function_tool(Trip)],  # strict: every field required, no extra keys
        tool_choice="required",
    )
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert isinstance(call.function.parsed_arguments, Trip)
        assert set(json.loads(call.function.arguments)) == set(Trip.model_fields)


def test_streamed_forced_call_with_a_nested_schema_matches_the_whole_reply(http: httpx.Client) -> None:
    fields = {"seed": 3, "max_tokens": 400, "tools": [TRIP_TOOL], "tool_choice": "required"}
    chunks = stream_chunks(http, **fields)
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    arguments = "".join(p["function"].get("arguments", "") for p in pieces)
    Trip.model_validate_json(arguments)
    whole = chat(http, **fields)["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == json.loads(whole)


def completed_parameters(arguments: dict[str, Any]) -> None:
    """Arguments of a cut call: only whole parameters, each valid on its own, and no markup anywhere."""
    fields = Trip.model_fields
    assert set(arguments) <= set(fields)
    for key, value in arguments.items():
        Trip.__pydantic_validator__.validate_assignment(Trip.model_construct(), key, value)
    assert "<" not in json.dumps(arguments) and "DSML" not in json.dumps(arguments)


@pytest.mark.parametrize("max_tokens", [30, 45, 60, 75, 90, 105])
def test_call_cut_by_max_tokens_has_only_completed_parameters_and_no_markup(
    http: httpx.Client, max_tokens: int
) -> None:
    fields = {"seed": 5, "max_tokens": max_tokens, "tools": [TRIP_TOOL], "tool_choice": PLAN_TRIP}
    choice = chat(http, **fields)["choices"][0]
    assert choice["finish_reason"] == "length"
    calls = choice["message"].get("tool_calls") or []
    assert len(calls) <= 1
    streamed = stream_chunks(http, **fields)
    pieces = [p for c in streamed for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    if not calls:  # cut before the call's name was complete: nothing of it is sent, streaming or not
        assert pieces == []
        return
    arguments = json.loads(calls[0]["function"]["arguments"])
    completed_parameters(arguments)
    assert json.loads("".join(p["function"].get("arguments", "") for p in pieces)) == arguments


def test_cut_calls_at_increasing_lengths_grow_one_whole_parameter_at_a_time(http: httpx.Client) -> None:
    seen: list[dict[str, Any]] = []
    for max_tokens in range(20, 200, 6):
        fields = {"seed": 5, "max_tokens": max_tokens, "tools": [TRIP_TOOL], "tool_choice": PLAN_TRIP}
        calls = chat(http, **fields)["choices"][0]["message"].get("tool_calls") or []
        if calls:
            seen.append(json.loads(calls[0]["function"]["arguments"]))
    full = json.loads(
        chat(http, seed=5, max_tokens=400, tools=[TRIP_TOOL], tool_choice=PLAN_TRIP)["choices"][0]["message"][
            "tool_calls"
        ][0]["function"]["arguments"]
    )
    assert len({json.dumps(a) for a in seen}) >= 3  # the cuts land on several different parameter counts
    for arguments in seen:
        completed_parameters(arguments)
        assert all(full[key] == value for key, value in arguments.items())


def test_tool_call_history_and_tool_results_are_accepted(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Go fast."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "set_mode", "arguments": '{"mode": "fast"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "done"},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=[MODE_TOOL],  # type: ignore[list-item]
        max_tokens=8,
        seed=1,
    )
    assert reply.choices[0].message.role == "assistant"


# ---- structured outputs ------------------------------------------------------------------------------------


def test_json_schema_reply_is_json_valid_for_the_schema(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=300,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}},
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)


def test_json_schema_in_thinking_mode_applies_after_the_reasoning(http: httpx.Client) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}
    message = chat(http, seed=1, response_format=format_, reasoning_effort="low")["choices"][0]["message"]
    assert message["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_regex_extension_constrains_the_reply(http: httpx.Client) -> None:
    body = chat(http, seed=5, response_format={"type": "regex", "regex": "(yes|no), [a-z]{2,8}"})
    content = body["choices"][0]["message"]["content"]
    head, _, word = content.partition(", ")
    assert head in ("yes", "no") and word.isalpha() and word.islower() and 2 <= len(word) <= 8


def test_same_seed_gives_the_same_reasoned_formatted_reply_alone_and_among_32_concurrent_requests(
    http: httpx.Client,
) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}
    target = {"seed": 7, "max_tokens": 200, "reasoning_effort": "low", "response_format": format_}
    alone = chat(http, **target)["choices"][0]["message"]
    others = [{"seed": 100 + i, "max_tokens": 40, "temperature": 0.9} for i in range(32)]
    with ThreadPoolExecutor(max_workers=33) as pool:
        futures = [pool.submit(chat, http, **fields) for fields in [*others[:16], target, *others[16:]]]
        replies = [f.result()["choices"][0]["message"] for f in futures]
    together = replies[16]
    assert together["reasoning_content"] == alone["reasoning_content"] and together["content"] == alone["content"]
    assert len({r["content"] for r in replies}) > 2, "the other requests really ran with their own seeds"


# ---- bad requests ------------------------------------------------------------------------------------------

BAD = [
    pytest.param(
        {"tools": [MODE_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        id="unknown-tool",
    ),
    pytest.param({"tool_choice": "required"}, "tool_choice", id="required-without-tools"),
    pytest.param({"tools": [MODE_TOOL], "tool_choice": "always"}, "tool_choice", id="unknown-tool-choice"),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "dict"}}}},
        "response_format",
        id="invalid-schema",
    ),
    pytest.param({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format", id="invalid-regex"),
    pytest.param(
        {"response_format": {"type": "json_object"}, "tools": [MODE_TOOL]}, "response_format", id="format-and-tools"
    ),
    pytest.param({"reasoning_effort": "extreme"}, "reasoning_effort", id="unknown-effort"),
    pytest.param({"reasoning_effort": 101}, "reasoning_effort", id="effort-out-of-range"),
    pytest.param({"reasoning_effort": True}, "reasoning_effort", id="effort-boolean"),
    pytest.param({"chat_template_kwargs": {"bogus": 1}}, "chat_template_kwargs.bogus", id="unknown-template-kwarg"),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", id="bad-tool-name"
    ),
    pytest.param(
        {"tools": [PING_TOOL, {"type": "function", "function": {"name": "f", "parameters": {"type": "dict"}}}]},
        "tools[1].function.parameters",
        id="invalid-tool-schema",
    ),
    pytest.param(
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Nowhere"}}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
        id="dangling-tool-ref",
    ),
    pytest.param(
        {
            "tools": [
                PING_TOOL,
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"n": {"type": "integer", "minimum": 3, "maximum": 2}}},
                    },
                },
            ],
            "tool_choice": "required",
        },
        "tools[1].function.parameters.properties.n",
        id="unsatisfiable-tool-schema",
    ),
    *(
        pytest.param(
            {"tools": [PING_TOOL, {"type": "function", "function": {"name": "f", "parameters": schema}}], **choice},
            "tools[1].function.parameters" + where,
            id=f"pathological-{name}-tool",
        )
        for name, schema, where in (
            ("bound", {"properties": {"n": {"type": "integer", "maximum": 10**1500}}}, ".properties.n.maximum"),
            ("nesting", {"properties": {"n": DEEP}}, ""),
            ("enum", {"properties": {"n": {"enum": list(range(5000))}}}, ""),
            ("multiple-of", {"properties": {"n": {"type": "integer", "multipleOf": 3}}}, ".properties.n"),
            ("lookahead", {"properties": {"n": {"type": "string", "pattern": "^(?=a)a+$"}}}, ".properties.n"),
        )
        for choice in ({"tool_choice": "required"},)
    ),
    *(
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "response_format" + where,
            id=f"pathological-{name}-format",
        )
        for name, schema, where in (
            ("bound", {"properties": {"n": {"minimum": -(10**1500)}}}, ".json_schema.schema.properties.n.minimum"),
            ("nesting", {"properties": {"n": DEEP}}, ""),
            ("enum", {"properties": {"n": {"enum": list(range(5000))}}}, ".json_schema.schema"),
        )
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_bad_deepseek_request_is_a_400_naming_the_parameter(
    http: httpx.Client, schemas: OpenAISchemas, fields: dict[str, Any], param: str, stream: bool
) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": stream, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    schemas.check("ErrorResponse", error)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error


# ---- DeepSeek's dialect (api-docs.deepseek.com), with the official SDK as DeepSeek's docs show it -----------


def library_ids(body: dict[str, Any]) -> list[int]:
    """The prompt ids deepseek-recipe's own converter and encoding give a DeepSeek-dialect Chat body."""
    tokenizer = recipe.Tokenizer.from_str(load_or_build().tokenizer.to_str())
    converted = recipe.ChatCompletionRequest({**body, "model": "DeepSeek-V4.1-Flash"}).convert(
        recipe.ConversionOptions()
    )
    return recipe.DeepseekV41Encoding().with_tokenizer(tokenizer).encode(converted.conversation)


def test_thinking_switch_in_extra_body_turns_thinking_on_and_off(
    client: openai.OpenAI, thinking_by_default: httpx.Client
) -> None:
    for seed in range(12):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=300,
            seed=seed,
            extra_body={"thinking": {"type": "enabled"}},
        )
        if completion.choices[0].message.model_extra.get("reasoning_content"):  # type: ignore[union-attr]
            break
    else:
        raise AssertionError("thinking enabled gave no reasoning_content in 12 seeds")
    off = chat(thinking_by_default, seed=0, thinking={"type": "disabled"})["choices"][0]["message"]
    assert "reasoning_content" not in off and off["content"]


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_thinking_switch_gives_the_librarys_prompt(http: httpx.Client, thinking: str) -> None:
    body = {"messages": QUESTION, "thinking": {"type": thinking}, "reasoning_effort": "max"}
    tokens = http.post("/tokenize", json={"model": MODEL, **body}).json()["tokens"]
    assert tokens == library_ids(body)


@pytest.mark.parametrize("base", ["/v1", "/beta"])
@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_prefix_continues_the_final_assistant_message(
    gateway: RunningGateway, http: httpx.Client, base: str, thinking: str
) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "Files are", "prefix": True}]
    body = {"messages": messages, "thinking": {"type": thinking}}
    expected = library_ids(body)
    assert http.post("/tokenize", json={"model": MODEL, **body}).json()["tokens"] == expected
    text = http.post("/detokenize", json={"model": MODEL, "tokens": expected}).json()["prompt"]
    assert text.endswith("<｜Assistant｜></think>Files are") or text.endswith("<｜Assistant｜><think></think>Files are")
    sdk = openai.OpenAI(base_url=f"{gateway.base_url}{base}", api_key="unused", max_retries=0, timeout=60)
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        seed=1,
        extra_body={"thinking": {"type": thinking}},
    )
    assert completion.usage is not None and completion.usage.prompt_tokens == len(expected)
    assert completion.choices[0].message.model_extra.get("reasoning_content") is None  # type: ignore[union-attr]


def test_prefix_on_a_message_that_is_not_the_final_assistant_one_is_a_400(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi", "prefix": True}, {"role": "assistant", "content": "x"}]
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].prefix"


def test_user_id_up_to_512_characters(http: httpx.Client) -> None:
    assert chat(http, user_id="u" * 512, max_tokens=1)["choices"]
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1, "user_id": "u" * 513}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "user_id"


def test_a_responses_user_up_to_512_characters(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 16, "store": False}
    assert http.post("/v1/responses", json={**body, "user": "u" * 512}).status_code == 200
    response = http.post("/v1/responses", json={**body, "user": "u" * 513})
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalties_are_ignored_in_thinking_mode_and_refused_outside_it(http: httpx.Client, penalty: str) -> None:
    """As on DeepSeek's API, thinking mode takes the penalties without an error; the engine cannot apply them."""
    assert chat(http, thinking={"type": "enabled"}, max_tokens=1, **{penalty: 0.5})["choices"]
    assert chat(http, reasoning_effort="low", max_tokens=1, **{penalty: 0.5})["choices"]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, penalty: 0.5}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == penalty


def test_thinking_mode_samples_at_temperature_one_whatever_the_request_asks(http: httpx.Client) -> None:
    """As deepseek-recipe and DeepSeek's API: temperature 0 is honoured outside thinking mode (every seed gives the
    greedy answer) and ignored in it (the seed decides, as at temperature 1.0)."""

    def text(seed: int, **fields: Any) -> str:
        message = chat(http, temperature=0, seed=seed, max_tokens=24, ignore_eos=True, **fields)["choices"][0]
        return (message["message"].get("reasoning_content") or "") + (message["message"]["content"] or "")

    assert len({text(seed, thinking={"type": "disabled"}) for seed in (1, 2, 3)}) == 1
    assert len({text(seed, thinking={"type": "enabled"}) for seed in (1, 2, 3)}) == 3
    assert text(5, thinking={"type": "enabled"}) == text(5, thinking={"type": "enabled"}), "seeded: reproducible"

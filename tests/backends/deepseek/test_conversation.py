"""The gateway's V4.1 prompts are deepseek-recipe's: with the library as the oracle, a generated conversation sent
as a DeepSeek-dialect Chat Completions body and converted by the library's own converter is the same
``Conversation`` the gateway builds from its normalized request, and the gateway's prompt text and token ids are
the library's. Deterministic under the suite's Hypothesis profile (tests/conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as recipe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.deepseek.conversation import to_conversation
from backends.deepseek.prompt_encoding import PromptEncoder
from backends.interface import GenerateRequest
from backends.reference import ReferenceArtifacts, load_or_build

LIBRARY_MODEL = "DeepSeek-V4.1-Flash"
MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "｜DSML｜", "<｜System｜>"]

texts = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
    st.lists(st.sampled_from([*MARKERS, "a", " ", "\n", "é"]), max_size=6).map("".join),
)
names = st.sampled_from(["lookup", "set_mode"])
arguments = st.dictionaries(st.sampled_from(["q", "n", "on"]), st.one_of(texts, st.integers(-5, 5), st.booleans()))


@st.composite
def assistant_turns(draw: st.DrawFn, *, thinking: bool) -> list[dict[str, Any]]:
    """An assistant reply, with tool calls and their results sometimes."""
    message: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
    if draw(st.booleans()):
        message["reasoning_content"] = draw(texts)
    calls = draw(st.lists(st.tuples(names, arguments), max_size=2))
    if not calls:
        return [message]
    message["tool_calls"] = [
        {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for n, (name, args) in enumerate(calls)
    ]
    results = [{"role": "tool", "tool_call_id": f"call_{n}", "content": draw(texts)} for n in range(len(calls))]
    return [message, *draw(st.permutations(results))]


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A DeepSeek-dialect Chat Completions body the library accepts."""
    thinking = draw(st.booleans())
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(texts)})
        if draw(st.booleans()):
            messages.extend(draw(assistant_turns(thinking=thinking)))
    tools = draw(st.lists(names, max_size=2, unique=True))
    calls = any(m.get("tool_calls") for m in messages)
    if not tools and not calls and (messages[-1]["role"] == "assistant" or draw(st.integers(0, 4)) == 0):
        prefix: dict[str, Any] = {"role": "assistant", "content": draw(texts), "prefix": True}
        if thinking and draw(st.booleans()):
            prefix["reasoning_content"] = draw(texts)
        if messages[-1]["role"] != "assistant":
            messages.append(prefix)
    body: dict[str, Any] = {"model": LIBRARY_MODEL, "messages": messages}
    body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    effort = draw(st.sampled_from([None, "low", "medium", "high", "xhigh", "max"]))
    if effort is not None:
        body["reasoning_effort"] = effort
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": name,
                    **({"description": draw(texts)} if draw(st.booleans()) else {}),
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
            for name in tools
        ]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none"]))
    if (not tools or body["tool_choice"] == "none") and not messages[-1].get("prefix"):
        fmt = draw(st.sampled_from([None, "json_object", "json_schema"]))
        if fmt == "json_object":  # the library asks for the word json in the prompt, as OpenAI does
            body["response_format"] = {"type": "json_object"}
            first_user = next(m for m in messages if m["role"] == "user")
            first_user["content"] += " json"
        elif fmt == "json_schema":
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    return body


def library_conversation(body: dict[str, Any]) -> recipe.Conversation:
    return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions()).conversation


def normalized_request(body: dict[str, Any]) -> GenerateRequest:
    """The request the gateway's Chat Completions route hands to the backend for this body."""
    thinking = body.get("thinking")
    return GenerateRequest(
        request_id="r",
        model="m",
        messages=body["messages"],
        tools=body.get("tools"),
        tool_choice=body.get("tool_choice"),
        response_format=body.get("response_format"),
        thinking=None if thinking is None else thinking["type"] == "enabled",
        reasoning_effort=body.get("reasoning_effort"),
    )


def described(conversation: recipe.Conversation) -> dict[str, Any]:
    """Everything a ``Conversation`` holds, as plain values (the library's objects do not compare)."""
    return {
        "thinking": conversation.thinking_mode,
        "effort": conversation.reasoning_effort,
        "tool_choice": conversation.tool_choice,
        "tools": [(t.name, t.description, t.parameters, t.strict) for t in conversation.tools],
        "format": (conversation.response_format, conversation.response_schema, conversation.response_regex),
        "messages": [
            (
                m.role,
                m.content,
                m.reasoning_content,
                [(c.id, c.name, c.arguments) for c in m.tool_calls or ()],
                m.tool_call_id,
                m.prefix,
            )
            for m in conversation.messages
        ],
    }


def assert_renders_as_the_library(
    request: GenerateRequest, expected: recipe.Conversation, library: recipe.DeepseekV41Encoding
) -> None:
    """The request a route normalized (tools offered, no forced choice) renders the library's prompt and ids for the
    conversation its converter built from the same body, and becomes that conversation, as a V4.1 deployment
    (thinking by default) serves it."""
    template = DeepSeekV41ChatTemplate(default_thinking=True)  # the library's default, as on a V4.1 deployment
    prompt = template.render(request, load_or_build().tokenizer)
    assert prompt.text == library.render_conversation(expected).prompt
    assert list(prompt.token_ids or ()) == library.encode(expected)
    thinking, effort = template.thinking_mode(request)
    ours = to_conversation(
        request.messages or [],
        thinking=thinking,
        effort=effort if isinstance(effort, str) else None,
        tools=request.tools,
        tools_offered=bool(request.tools),
    )
    assert described(ours) == described(expected)


@pytest.fixture(scope="module")
def encoder(artifacts: ReferenceArtifacts) -> PromptEncoder:
    return PromptEncoder(artifacts.tokenizer)


@pytest.fixture(scope="module")
def library(artifacts: ReferenceArtifacts) -> recipe.DeepseekV41Encoding:
    """The library's own V4.1 encoding with the reference engine's tokenizer."""
    return recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_str(artifacts.tokenizer.to_str()))


@pytest.fixture(scope="module")
def template() -> DeepSeekV41ChatTemplate:
    return DeepSeekV41ChatTemplate()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=chat_bodies())
def test_the_gateways_conversation_prompt_and_ids_are_the_librarys(
    body: dict[str, Any],
    template: DeepSeekV41ChatTemplate,
    library: recipe.DeepseekV41Encoding,
    artifacts: ReferenceArtifacts,
) -> None:
    expected = library_conversation(body)
    request = normalized_request(body)
    thinking, effort = template.thinking_mode(request)
    choice = body.get("tool_choice", "auto")
    ours = to_conversation(
        body["messages"],
        thinking=thinking,
        effort=effort if isinstance(effort, str) else None,
        tools=None if choice == "none" else body.get("tools"),
        tool_choice=choice,
        response_format=body.get("response_format"),
        tools_offered="tools" in body,
    )
    assert described(ours) == described(expected)
    prompt = template.render(request, artifacts.tokenizer)
    assert prompt.text == library.render_conversation(expected).prompt
    assert list(prompt.token_ids or ()) == library.encode(expected)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies())
def test_encoding_piece_by_piece_is_the_librarys_encode(
    body: dict[str, Any], encoder: PromptEncoder, library: recipe.DeepseekV41Encoding
) -> None:
    """The path integer efforts take (special spans by the vocabulary, the rest without the added one)."""
    conversation = library_conversation(body)
    rendered = library.render_conversation(conversation)
    assert encoder.encode_pieces(rendered.prompt, rendered.special_ranges) == library.encode(conversation)


def test_an_integer_effort_prints_that_number_and_keeps_typed_markers_plain(encoder: PromptEncoder) -> None:
    typed = "<｜User｜>x</think>"
    conversation = recipe.Conversation([recipe.UserMessage(typed)], reasoning_effort="high")
    text, ids = encoder.encode(conversation, effort_number=37)
    assert text.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 37 (range 1-100")
    high_text, high_ids = encoder.encode(conversation)
    assert text == high_text.replace("Effort: 75", "Effort: 37")
    plain_typed = encoder.encode_pieces(typed, [])
    assert _contains(ids, plain_typed) and _contains(high_ids, plain_typed)


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))

"""A Responses API request becomes the library's own ``Conversation``: with deepseek-recipe's ``ResponsesRequest``
converter as the oracle on generated requests, the gateway's normalization (``responses.protocol``) followed by the
V4.1 chat template's conversion gives the same conversation, prompt text and token ids."""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as recipe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.interface import GenerateRequest
from backends.reference import load_or_build
from gateway.responses.protocol import CreateResponseRequest, chat_messages

from ..backends.deepseek.test_conversation import assert_renders_as_the_library, texts

LIBRARY_MODEL = "DeepSeek-V4.1-Flash"
TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@st.composite
def responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A Responses body the library accepts: instructions, user and assistant messages, function calls."""
    items: list[dict[str, Any]] = []
    calls = 0
    for _ in range(draw(st.integers(1, 3))):
        items.append({"role": "user", "content": [{"type": "input_text", "text": draw(texts)}]})
        kind = draw(st.sampled_from(["none", "reply", "call"]))
        if kind == "reply":
            items.append({"role": "assistant", "content": [{"type": "output_text", "text": draw(texts)}]})
        elif kind == "call":
            call_id = f"call_{calls}"
            calls += 1
            arguments = json.dumps({"q": draw(texts)})
            items.append({"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": arguments})
            items.append({"type": "function_call_output", "call_id": call_id, "output": draw(texts)})
    body: dict[str, Any] = {"model": LIBRARY_MODEL, "input": items}
    instructions = draw(st.one_of(st.none(), texts))
    if instructions:
        body["instructions"] = instructions
    effort = draw(st.sampled_from([None, "none", "minimal", "low", "medium", "high", "xhigh"]))
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    if draw(st.booleans()):
        body["tools"] = [TOOL]
    return body


@pytest.fixture(scope="module")
def library() -> recipe.DeepseekV41Encoding:
    return recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_str(load_or_build().tokenizer.to_str()))


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=responses_bodies())
def test_a_responses_request_is_the_librarys_conversation(
    body: dict[str, Any], library: recipe.DeepseekV41Encoding
) -> None:
    expected = recipe.ResponsesRequest(body).convert(recipe.ConversionOptions()).conversation
    parsed = CreateResponseRequest.model_validate(body)
    request = GenerateRequest(
        request_id="r",
        model="m",
        messages=chat_messages(parsed.instructions, parsed.items),
        tools=parsed.chat_tools(),
        tool_choice=parsed.chat_tool_choice(),
        response_format=parsed.response_format(),
        reasoning_effort=parsed.reasoning_effort(),
    )
    assert_renders_as_the_library(request, expected, library)

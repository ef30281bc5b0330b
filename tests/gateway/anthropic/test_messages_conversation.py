"""A Messages API request becomes the library's own ``Conversation``: with deepseek-recipe's ``MessagesRequest``
converter as the oracle on generated requests, the gateway's translation (``anthropic.translate``) followed by the
V4.1 chat template gives the same conversation, prompt text and token ids, DeepSeek's
``thinking: {"type": "enabled"}`` without ``budget_tokens`` included."""

from __future__ import annotations

from typing import Any

import deepseek_recipe as recipe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.reference import load_or_build
from gateway.anthropic.protocol import MessagesRequest
from gateway.anthropic.signatures import ThinkingSigner
from gateway.anthropic.translate import generate_request

from ...backends.deepseek.test_conversation import assert_renders_as_the_library, texts

SIGNER = ThinkingSigner.from_secret("conversation oracle secret")
TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
nonempty = texts.filter(lambda text: text.strip() != "")  # Anthropic refuses blank text blocks


@st.composite
def messages_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A Messages body both sides accept: text turns, tool uses and their results, DeepSeek's thinking switch."""
    messages: list[dict[str, Any]] = []
    calls = 0
    for _ in range(draw(st.integers(1, 3))):
        if not messages or messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": draw(nonempty)})
        blocks: list[dict[str, Any]] = [{"type": "text", "text": draw(nonempty)}]
        if draw(st.booleans()):
            call_id = f"toolu_{calls}"
            calls += 1
            blocks.append({"type": "tool_use", "id": call_id, "name": "lookup", "input": {"q": draw(texts)}})
            messages.append({"role": "assistant", "content": blocks})
            result = {"type": "tool_result", "tool_use_id": call_id, "content": draw(nonempty)}
            messages.append({"role": "user", "content": [result, {"type": "text", "text": draw(nonempty)}]})
        else:
            messages.append({"role": "assistant", "content": blocks})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": draw(nonempty)})
    body: dict[str, Any] = {"model": "DeepSeek-V4.1-Flash", "max_tokens": 16, "messages": messages}
    system = draw(st.one_of(st.none(), nonempty))
    if system is not None:
        body["system"] = system
    thinking = draw(st.sampled_from([None, "enabled", "disabled"]))
    if thinking is not None:
        body["thinking"] = {"type": thinking}
    if calls or draw(st.booleans()):
        body["tools"] = [TOOL]
    return body


@pytest.fixture(scope="module")
def library() -> recipe.DeepseekV41Encoding:
    return recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_str(load_or_build().tokenizer.to_str()))


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=messages_bodies())
def test_a_messages_request_is_the_librarys_conversation(
    body: dict[str, Any], library: recipe.DeepseekV41Encoding
) -> None:
    expected = recipe.MessagesRequest(body).convert(recipe.ConversionOptions()).conversation
    request = generate_request(
        MessagesRequest.model_validate(body), request_id="r", model="m", signer=SIGNER, max_buffered_tokens=None
    )
    assert_renders_as_the_library(request, expected, library)

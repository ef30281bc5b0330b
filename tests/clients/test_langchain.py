"""LangChain's OpenAI chat model (``langchain-openai``) against the gateway with nested Pydantic schemas.

``with_structured_output`` in both its function-calling and its json_schema method, ``bind_tools`` with a tool
whose arguments are a nested model, and the same tool call streamed. The schemas (``structured_models``) carry
``$ref``/``$defs``, enums, ``anyOf`` and bounds: parsing succeeds only if the gateway constrains the forced call
by the whole schema. Greedy decoding and a fixed seed keep every reply the same from run to run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI

from ..conftest import MODEL, RunningGateway
from .structured_models import BookTrip, Forecast, check_forecast, check_trip

PROMPT = "What is the weather going to be like in Paris this week?"
TRIP = "Book a trip to Kyoto for me and my sister, window seats please."


@pytest.fixture(scope="module")
def llm(gateway: RunningGateway) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{gateway.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        seed=7,
        max_tokens=400,  # above the longest reply the bounded schemas allow (DSML markup included)
        max_retries=0,
        timeout=120,
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_parses_a_nested_model(llm: ChatOpenAI, method: str) -> None:
    result: dict[str, Any] = llm.with_structured_output(Forecast, method=method, include_raw=True).invoke(PROMPT)  # type: ignore[assignment]
    assert result["parsing_error"] is None
    check_forecast(result["parsed"])
    raw: AIMessage = result["raw"]
    if method == "function_calling":
        (call,) = raw.tool_calls
        assert call["name"] == "Forecast"
        assert Forecast.model_validate(call["args"]) == result["parsed"]
    else:
        assert not raw.tool_calls
        assert Forecast.model_validate_json(str(raw.content)) == result["parsed"]


# LangChain inlines a model's $defs when it converts it to a tool; the dict form keeps pydantic's own schema ($ref).
RAW_TOOL = {
    "type": "function",
    "function": {"name": "BookTrip", "description": "Books a trip.", "parameters": BookTrip.model_json_schema()},
}


@pytest.mark.parametrize(
    ("tool", "tool_choice"),
    [(BookTrip, "BookTrip"), (BookTrip, "any"), (RAW_TOOL, "BookTrip")],
    ids=["named", "any", "refs"],
)
def test_bind_tools_with_nested_arguments(llm: ChatOpenAI, tool: Any, tool_choice: str) -> None:
    reply = llm.bind_tools([tool], tool_choice=tool_choice).invoke(TRIP)
    assert isinstance(reply, AIMessage)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    (call,) = reply.tool_calls
    assert call["name"] == "BookTrip"
    assert not reply.invalid_tool_calls
    check_trip(BookTrip.model_validate(call["args"]))


def test_streamed_tool_call_matches_the_unstreamed_one(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([BookTrip], tool_choice="BookTrip")
    chunks = list(bound.stream(TRIP))
    assert len(chunks) > 2  # a real stream: role, call header, arguments and finish come as separate chunks
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert isinstance(merged, AIMessageChunk)
    assert not merged.invalid_tool_calls
    (call,) = merged.tool_calls
    assert call["name"] == "BookTrip"
    streamed = BookTrip.model_validate(call["args"])
    check_trip(streamed)
    pieces = "".join(str(c["args"] or "") for chunk in chunks for c in chunk.tool_call_chunks)  # type: ignore[attr-defined]
    assert json.loads(pieces) == call["args"]  # the fragments concatenate to exactly the final arguments
    (unstreamed,) = bound.invoke(TRIP).tool_calls  # type: ignore[attr-defined]
    assert BookTrip.model_validate(unstreamed["args"]) == streamed

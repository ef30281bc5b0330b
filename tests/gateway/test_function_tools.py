"""The chat and Responses APIs refuse a function tool or a tool_choice the same way: one validator, each API's path."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.openai.parameters import ParameterError, UnsupportedParameter
from gateway.openai.protocol import ChatCompletionRequest
from gateway.responses.protocol import CreateResponseRequest

from ..conftest import MODEL

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}


def chat_tool(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": function}


def responses_tool(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **function}


# (id, the functions declared (the last one is wrong), the wrong field, the code both APIs answer with)
BAD_FUNCTIONS = [
    pytest.param([{"name": "bad name"}], "name", "invalid_value", id="name-with-a-space"),
    pytest.param([{"name": ""}], "name", "invalid_value", id="empty-name"),
    pytest.param([{"name": "n" * 65}], "name", "invalid_value", id="name-too-long"),
    pytest.param([{"name": 7}], "name", "invalid_value", id="name-not-a-string"),
    pytest.param([{"parameters": {}}], "name", "invalid_value", id="no-name"),
    pytest.param([WEATHER, {"name": "get_weather"}], "name", "invalid_value", id="name-given-twice"),
    pytest.param([{"name": "f", "parameters": "object"}], "parameters", "invalid_value", id="parameters-not-object"),
]


def _error(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def _why(error: dict[str, Any]) -> str:
    """The message without the parameter it names (the two APIs name it differently)."""
    return error["message"].replace(error["param"], "<param>")


@pytest.mark.parametrize(("functions", "field", "code"), BAD_FUNCTIONS)
def test_a_bad_function_tool_gets_the_same_400_from_chat_and_responses(
    http: httpx.Client, functions: list[dict[str, Any]], field: str, code: str
) -> None:
    last = len(functions) - 1
    chat = _error(
        http,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [chat_tool(f) for f in functions]},
    )
    responses = _error(http, "/v1/responses", {"input": "hi", "tools": [responses_tool(f) for f in functions]})
    assert chat["param"] == f"tools[{last}].function.{field}"
    assert responses["param"] == f"tools[{last}].{field}"
    assert chat["code"] == responses["code"] == code
    assert _why(chat) == _why(responses)
    assert chat["message"].startswith("Invalid value for")


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        pytest.param("custom", "unsupported_value", id="custom-is-defined-by-both"),
        pytest.param("retrieval", "invalid_value", id="unknown-to-both"),
    ],
)
def test_a_tool_that_is_not_a_function_gets_the_same_400_from_chat_and_responses(
    http: httpx.Client, kind: str, code: str
) -> None:
    tool = {"type": kind, "name": "f"}
    chat = _error(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    responses = _error(http, "/v1/responses", {"input": "hi", "tools": [tool]})
    assert chat["param"] == responses["param"] == "tools[0].type"
    assert chat["code"] == responses["code"] == code
    assert chat["message"] == responses["message"]


def test_a_responses_builtin_tool_is_unsupported_not_invalid(http: httpx.Client) -> None:
    error = _error(http, "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]})
    assert error["param"] == "tools[0].type" and error["code"] == "unsupported_value", error


@pytest.mark.parametrize(("functions", "field", "code"), BAD_FUNCTIONS)
def test_both_request_models_raise_the_same_parameter_error(
    functions: list[dict[str, Any]], field: str, code: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    problems = []
    for build in (
        lambda: ChatCompletionRequest(model="m", messages=messages, tools=[chat_tool(f) for f in functions]),
        lambda: CreateResponseRequest(model="m", input="hi", tools=[responses_tool(f) for f in functions]),
    ):
        with pytest.raises(ValidationError) as caught:
            build()
        problem = caught.value.errors()[0]["ctx"]["error"]
        assert isinstance(problem, ParameterError) and not isinstance(problem, UnsupportedParameter)
        problems.append(problem)
    chat, responses = problems
    assert type(chat) is type(responses) and chat.code == responses.code == code
    assert chat.why == responses.why
    assert chat.where.replace(".function.", ".") == responses.where


def chat_choice(name: object) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def responses_choice(name: object) -> dict[str, Any]:
    return {"type": "function", "name": name}


# (id, the tools declared, the chat tool_choice, the Responses one, the chat param, the Responses param, the code)
BAD_CHOICES = [
    pytest.param([], "sometimes", "sometimes", "tool_choice", "tool_choice", "invalid_value", id="unknown-mode"),
    pytest.param([], "required", "required", "tool_choice", "tool_choice", None, id="required-without-tools"),
    pytest.param(
        [WEATHER],
        chat_choice("get_time"),
        responses_choice("get_time"),
        "tool_choice",
        "tool_choice",
        None,
        id="names-a-function-not-in-tools",
    ),
    pytest.param(
        [WEATHER],
        chat_choice(5),
        responses_choice(5),
        "tool_choice.function.name",
        "tool_choice.name",
        "invalid_value",
        id="name-not-a-string",
    ),
    pytest.param(
        [WEATHER],
        {"type": "allowed_tools", "mode": "auto", "tools": []},
        {"type": "allowed_tools", "mode": "auto", "tools": []},
        "tool_choice.type",
        "tool_choice.type",
        "unsupported_value",
        id="allowed-tools",
    ),
    pytest.param(
        [WEATHER],
        {"type": "tool", "name": "get_weather"},
        {"type": "tool", "name": "get_weather"},
        "tool_choice.type",
        "tool_choice.type",
        "invalid_value",
        id="unknown-type",
    ),
]


@pytest.mark.parametrize(("functions", "chat_choice", "responses_choice", "chat_param", "param", "code"), BAD_CHOICES)
def test_a_bad_tool_choice_gets_the_same_400_from_chat_and_responses(
    http: httpx.Client,
    functions: list[dict[str, Any]],
    chat_choice: object,
    responses_choice: object,
    chat_param: str,
    param: str,
    code: str | None,
) -> None:
    chat_body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": chat_choice}
    responses_body: dict[str, Any] = {"input": "hi", "tool_choice": responses_choice}
    if functions:
        chat_body["tools"] = [chat_tool(f) for f in functions]
        responses_body["tools"] = [responses_tool(f) for f in functions]
    chat = _error(http, "/v1/chat/completions", chat_body)
    responses = _error(http, "/v1/responses", responses_body)
    assert (chat["param"], responses["param"]) == (chat_param, param)
    assert chat["code"] == responses["code"] == code
    assert _why(chat) == _why(responses)

"""Property tests of OpenAI's request contract, with requests generated from the ``openai`` package's own request
types: valid ones are served (200) or refused with a 400 that names an unsupported feature; invalid ones (wrong
types, out of range, unknown fields, nested garbage) get a 400 whose ``param`` is the offending path. Never a 5xx.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_params

from ..conformance import OpenAISchemas
from ..conftest import MODEL
from .openai_types import JSON_KINDS, JSON_VALUES, TEXT, VALUES_OF_KIND, from_type, json_kinds, wire_fields

CHAT_TYPE = chat_params.CompletionCreateParamsNonStreaming
COMPLETION_TYPE = completion_params.CompletionCreateParamsNonStreaming
EXAMPLES = settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Ranges OpenAI documents in prose (the types carry none), and small outputs to keep the run short.
BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
}
INT_BOUNDS: dict[str, tuple[int, int]] = {"n": (1, 128), "top_logprobs": (0, 20), "max_tokens": (1, 2**31 - 1)}
JSON_SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "string"}, {"type": "object", "properties": {}}])
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    **{
        name: st.none() | st.floats(low, high) | st.integers(int(low), int(high))
        for name, (low, high) in BOUNDS.items()
    },
    "n": st.none() | st.integers(1, 2),
    "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 200).map(str), st.integers(-100, 100), max_size=2),
    "max_tokens": st.none() | st.integers(1, 3),
    "max_completion_tokens": st.none() | st.integers(1, 3),
    "top_logprobs": st.none() | st.integers(0, 20),
    "name": st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    "arguments": st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), TEXT, max_size=2).map(json.dumps),
    "schema": JSON_SCHEMAS,
    "parameters": JSON_SCHEMAS,
}
CHAT_OVERRIDES = {
    **COMMON,
    "messages": st.lists(from_type(ChatCompletionMessageParam, COMMON), min_size=1, max_size=3),
    "tools": st.lists(from_type(wire_fields(CHAT_TYPE)["tools"][0], COMMON).map(list), max_size=1).map(
        lambda lists: lists[0] if lists else []
    ),
}
COMPLETION_OVERRIDES = {
    **COMMON,
    "max_tokens": st.none() | st.integers(1, 3),
    "logprobs": st.none() | st.integers(0, 5),
    "best_of": st.none() | st.integers(1, 2),
    "prompt": st.none()
    | TEXT
    | st.lists(TEXT, min_size=1, max_size=2)
    | st.lists(st.integers(0, 255), min_size=1, max_size=4)
    | st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=4), min_size=1, max_size=2),
}


def _consistent_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Rules OpenAI states between fields (and enforces with 400s): applied so that the request is valid."""
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        del body["max_tokens"]
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 2  # else the reference model fills its context
    for message in body["messages"]:  # OpenAI's schema: an array of content parts has at least one
        if message.get("content") == []:
            message["content"] = ""
    tools = [t for t in body.get("tools") or () if t.get("type") == "function"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        if tools and isinstance(choice, dict) and choice.get("type") == "function":
            choice["function"]["name"] = tools[0]["function"]["name"]
        elif not tools or (isinstance(choice, dict) and choice.get("type") == "function"):
            body.pop("tool_choice")
    return body


def _consistent_completion(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    return body


VALID = [
    pytest.param("/v1/chat/completions", from_type(CHAT_TYPE, CHAT_OVERRIDES).map(_consistent_chat), id="chat"),
    pytest.param(
        "/v1/completions",
        from_type(COMPLETION_TYPE, COMPLETION_OVERRIDES).map(_consistent_completion),
        id="completions",
    ),
]
RESPONSE_SCHEMA = {
    "/v1/chat/completions": "CreateChatCompletionResponse",
    "/v1/completions": "CreateCompletionResponse",
}


def assert_unsupported_or_served(path: str, response: httpx.Response, body: dict[str, Any]) -> None:
    assert response.status_code < 500, f"{body} -> {response.status_code} {response.text[:300]}"
    if response.status_code == 200:
        OpenAISchemas.load().check(RESPONSE_SCHEMA[path], response.json())
        return
    assert response.status_code == 400, f"{body} -> {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    names_a_feature = error["param"] and "not supported" in error["message"]
    assert names_a_feature or error["code"] == "context_length_exceeded", f"{body} -> {error}"


@pytest.mark.parametrize(("path", "requests"), VALID)
def test_requests_valid_by_openais_types_are_served_or_name_an_unsupported_feature(
    http: httpx.Client, path: str, requests: st.SearchStrategy[dict[str, Any]]
) -> None:
    @EXAMPLES
    @given(body=requests)
    def check(body: dict[str, Any]) -> None:
        assert_unsupported_or_served(path, http.post(path, json=body), body)

    check()


# --- invalid requests ---------------------------------------------------------------------------------------------

BASES = {
    "/v1/chat/completions": (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        CHAT_TYPE,
    ),
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 1}, COMPLETION_TYPE),
}
EXTENSIONS = {"reasoning_effort"}  # takes an integer too (1-100), beyond OpenAI's strings


@st.composite
def wrong_types(draw: st.DrawFn, path: str) -> tuple[dict[str, Any], str]:
    """A valid body with one field of a JSON kind OpenAI's type for it does not allow (null aside: where the
    gateway takes null for a field OpenAI does not declare nullable, that is leniency, not a wrong answer)."""
    base, typed = BASES[path]
    fields = {name: hint for name, (hint, _) in wire_fields(typed).items() if name not in EXTENSIONS}
    name = draw(st.sampled_from(sorted(fields)))
    allowed = json_kinds(fields[name])
    kind = draw(st.sampled_from([k for k in JSON_KINDS if k not in allowed and k != "null"]))
    return {**base, name: draw(VALUES_OF_KIND[kind])}, name


@st.composite
def out_of_range(draw: st.DrawFn, path: str) -> tuple[dict[str, Any], str]:
    base, _ = BASES[path]
    # /v1/completions takes max_tokens 0 (with echo: score the prompt), as OpenAI's legacy API does
    legacy = {"logprobs": (0, 5), "max_tokens": (0, 2**31 - 1)} if path == "/v1/completions" else {}
    bounds = {**BOUNDS, **INT_BOUNDS, **legacy}
    name = draw(st.sampled_from(sorted(bounds)))
    low, high = bounds[name]
    integer = name in INT_BOUNDS or name == "logprobs"
    below = st.integers(-(2**40), int(low) - 1) if integer else st.floats(-1e9, low, exclude_max=True)
    above = st.integers(int(high) + 1, 2**40) if integer else st.floats(high, 1e9, exclude_min=True)
    return {**base, name: draw(below | above)}, name


@st.composite
def unknown_fields(draw: st.DrawFn, path: str) -> tuple[dict[str, Any], str]:
    base, typed = BASES[path]
    known = set(wire_fields(typed)) | {"stream"}
    name = draw(st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True).filter(lambda n: n not in known))
    return {**base, name: draw(JSON_VALUES)}, name


@st.composite
def nested_garbage(draw: st.DrawFn, path: str) -> tuple[dict[str, Any], str]:
    """Garbage one or more levels down; the error names a path at or below the place it was put."""
    garbage = draw(st.one_of(st.booleans(), st.integers(), TEXT, st.lists(JSON_VALUES, max_size=2)))
    base, _ = BASES[path]
    if path == "/v1/completions":
        where = draw(st.sampled_from(["prompt", "stream_options", "logit_bias"]))
        value = {
            "prompt": [[1, 2], garbage],
            "stream_options": {"include_usage": garbage},
            "logit_bias": {"1": garbage},
        }
        params = {"prompt": "prompt[1]", "stream_options": "stream_options.include_usage", "logit_bias": "logit_bias.1"}
        assume(where != "prompt" or not isinstance(garbage, str))  # ["..."] lists of strings are prompts
        assume(where != "prompt" or not isinstance(garbage, list))  # [[1, 2], [0]] are two token-id prompts
        assume(where != "stream_options" or not isinstance(garbage, bool))
        assume(where != "logit_bias" or type(garbage) is not int or abs(garbage) > 100)
        return {**base, where: value[where]}, params[where]
    index = draw(st.integers(0, 2))
    messages: list[Any] = [{"role": "user", "content": "hi"} for _ in range(3)]
    place = draw(st.sampled_from(["message", "content", "part", "part-type", "stream_options"]))
    if place == "message":
        messages[index] = garbage
        return {**base, "messages": messages}, f"messages[{index}]"
    if place == "content":
        assume(not isinstance(garbage, str | list))
        messages[index] = {"role": "user", "content": garbage}
        return {**base, "messages": messages}, f"messages[{index}].content"
    if place == "part":
        assume(not isinstance(garbage, list))
        messages[index] = {"role": "user", "content": [{"type": "text", "text": "a"}, garbage]}
        return {**base, "messages": messages}, f"messages[{index}].content[1]"
    if place == "part-type":
        assume(garbage != "text")
        messages[index] = {"role": "user", "content": [{"type": garbage, "text": "a"}]}
        return {**base, "messages": messages}, f"messages[{index}].content[0].type"
    assume(not isinstance(garbage, bool))
    return {**base, "stream": True, "stream_options": {"include_usage": garbage}}, "stream_options.include_usage"


INVALID = [
    pytest.param(kind, path, id=f"{kind.__name__}-{path.removeprefix('/v1/').replace('/', '-')}")
    for kind in (wrong_types, out_of_range, unknown_fields, nested_garbage)
    for path in BASES
]


@pytest.mark.parametrize(("kind", "path"), INVALID)
def test_invalid_requests_are_a_400_naming_the_parameter(http: httpx.Client, kind: Any, path: str) -> None:
    @EXAMPLES
    @given(case=kind(path))
    def check(case: tuple[dict[str, Any], str]) -> None:
        body, param = case
        response = http.post(path, json=body)
        assert response.status_code == 400, f"{body} -> {response.status_code} {response.text[:300]}"
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param or (error["param"] or "").startswith((f"{param}.", f"{param}[")), (body, error)

    check()

"""Every field of every request body, given a value of every other JSON type: never a 5xx, and a 4xx is the error of
the API that was called (OpenAI's shape, or Anthropic's on the Messages routes) naming the field's full path.

The substitution is exhaustive rather than sampled: each base body is a valid request with most of its route's
fields set, and every node of it (top-level fields, list items, nested objects, down to a tool's JSON schema) is
replaced in turn by a null, a boolean, an integer, a float, a string, a list and an object, whichever it is not.
All requests of a route go over one kept-alive connection, so a response after which the server drops the
connection (as a 500 once did) fails the next request too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.batches.routes import CreateBatchRequest
from gateway.config import GatewayConfig
from gateway.endpoints.tokenize import DetokenizeRequest, TokenizeRequest
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses.protocol import CreateResponseRequest

from ..conftest import RunningGateway, start_gateway, stop_gateway
from .openai_types import json_kind

MODEL = "substitution-model"
SUBSTITUTES: dict[str, list[Any]] = {
    "null": [None],
    "boolean": [True],
    "integer": [3],
    "number": [2.5],
    "string": ["x"],
    "array": [[], ["x"]],
    "object": [{}, {"type": {}}],
}
"""Values of each JSON type put where another type stands: the empty and a non-empty list, an empty object and one
whose ``type`` (the discriminator of most tagged unions in these APIs) is itself an object."""

TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
    {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]
BASES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {
            "model": MODEL,
            "messages": CHAT_MESSAGES,
            "max_tokens": 1,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 1,
            "stop": ["\n"],
            "n": 1,
            "logprobs": True,
            "top_logprobs": 1,
            "user": "u",
            "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": TOOL_SCHEMA}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        },
        {
            "model": MODEL,
            "messages": [{"role": "developer", "content": "Reply in JSON."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": TOOL_SCHEMA}},
            "reasoning_effort": "low",
        },
    ],
    "/v1/completions": [
        {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "stop": "\n",
            "seed": 1,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 1,
            "user": "u",
        },
        {
            "model": MODEL,
            "prompt": [[5, 6], [7]],
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ],
    "/v1/responses": [
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "f", "parameters": TOOL_SCHEMA}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_output_tokens": 16,
            "temperature": 0.5,
            "top_p": 0.9,
            "store": False,
            "metadata": {"k": "v"},
            "reasoning": {"effort": "low"},
            "user": "u",
            "parallel_tool_calls": True,
        },
        {
            "model": MODEL,
            "input": "Hi",
            "max_output_tokens": 16,
            "stream": True,
            "store": False,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": TOOL_SCHEMA}},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 1,
        },
    ],
    "/v1/messages": [
        {
            "model": MODEL,
            "max_tokens": 1,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "x"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]},
            ],
            "tools": [{"name": "f", "description": "d", "input_schema": TOOL_SCHEMA}],
            "tool_choice": {"type": "auto"},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "metadata": {"user_id": "u"},
        },
        {
            "model": MODEL,
            "max_tokens": 1025,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stop_sequences": ["END"],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ],
    "/v1/messages/count_tokens": [
        {
            "model": MODEL,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "tools": [{"name": "f", "input_schema": TOOL_SCHEMA}],
        }
    ],
    "/tokenize": [
        {
            "model": MODEL,
            "messages": CHAT_MESSAGES,
            "add_generation_prompt": True,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL_SCHEMA}}],
            "return_token_strs": True,
        },
        {"model": MODEL, "prompt": "Hi", "add_special_tokens": True},
    ],
    "/detokenize": [{"model": MODEL, "tokens": [5, 6, 7]}],
    "/v1/batches": [
        {
            "input_file_id": "",  # the fixture's uploaded file (BATCH_FILE)
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"k": "v"},
        }
    ],
}


MINIMAL: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 16, "store": False},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "Hi"},
    "/detokenize": {"model": MODEL, "tokens": [5]},
    "/v1/batches": BASES["/v1/batches"][0],
}
"""The smallest valid body of each route, for the fields no base body sets."""
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": CreateResponseRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/batches": CreateBatchRequest,
}
"""Each route's request model: every field it declares, set or not in the base bodies, gets every JSON type."""


def _nodes(value: Any, path: str = "") -> Iterator[tuple[str, tuple[str | int, ...], Any]]:
    """Every node below ``value`` (not itself): its path as OpenAI writes it, its keys, and its value."""
    items = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    for key, child in items:
        child_path = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        yield child_path, (key,), child
        for deeper, keys, grandchild in _nodes(child, child_path):
            yield deeper, (key, *keys), grandchild


def _replaced(value: Any, keys: tuple[str | int, ...], new: Any) -> Any:
    if not keys:
        return new
    head, rest = keys[0], keys[1:]
    if isinstance(value, list):
        assert isinstance(head, int)
        return [_replaced(item, rest, new) if i == head else item for i, item in enumerate(value)]
    return {k: _replaced(item, rest, new) if k == head else item for k, item in value.items()}


def substitutions(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(the substituted path, the body) for every node of every base body of ``path`` and every other JSON type,
    and for every field of the route's request model that no base body sets, every JSON type in the minimal body."""
    cases = []
    for base in BASES[path]:
        for where, keys, value in _nodes(base):
            for kind, values in SUBSTITUTES.items():
                if kind != json_kind(value):
                    cases.extend((where, _replaced(base, keys, new)) for new in values)
    covered = {name for base in BASES[path] for name in base}
    for name, field in REQUEST_MODELS[path].model_fields.items():
        wire = field.alias or name
        if wire not in covered:
            cases.extend((wire, {**MINIMAL[path], wire: new}) for values in SUBSTITUTES.values() for new in values)
    return cases


def _related(param: str, where: str, null: bool) -> bool:
    """Whether an error's path is the substituted one, above it (the object that holds it, when the substitution
    changed which kind of object it is) or below it (a field of the substituted object). A null is the field left
    out, which may leave another field without what it needs (``top_logprobs`` without ``logprobs``): then the
    error names that one. Items of one list may depend on each other (a prompt's token ids are all ids; a
    tool_result answers the tool_use of the turn before): a substituted item can make another item the one in
    error (``[3, [7]]`` is read as token ids with a bad ``[1]``)."""
    if null or _in_the_same_list(param, where):
        return True
    return any(
        longer == shorter or longer.startswith((f"{shorter}.", f"{shorter}["))
        for longer, shorter in ((where, param), (param, where))
    )


def _in_the_same_list(param: str, where: str) -> bool:
    return any(param.startswith(where[: index.start() + 1]) for index in re.finditer(r"\[\d+\]", where))


@pytest.fixture(scope="module")
def gateway() -> Iterator[RunningGateway]:
    """The reference engine with a short context, so whatever a substitution lets through generates little."""
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "max_model_len": 1024}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": MINIMAL["/v1/chat/completions"]}
    upload = httpx.post(
        f"{running.base_url}/v1/files",
        files={"file": ("batch.jsonl", json.dumps(line).encode())},
        data={"purpose": "batch"},
    )
    assert upload.status_code == 200, upload.text
    BASES["/v1/batches"][0]["input_file_id"] = upload.json()["id"]
    yield running
    stop_gateway(running)


@pytest.mark.parametrize("path", sorted(BASES))
def test_the_base_bodies_are_served(gateway: RunningGateway, path: str) -> None:
    """The substitutions start from valid requests, so every error below is the substituted value's."""
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        for body in [*BASES[path], MINIMAL[path]]:
            response = http.post(path, json=body)
            assert response.status_code == 200, (body, response.text[:500])


@pytest.mark.parametrize("path", sorted(BASES))
def test_a_value_of_another_json_type_anywhere_is_a_4xx_naming_its_path(gateway: RunningGateway, path: str) -> None:
    anthropic = path.startswith("/v1/messages")
    failures: list[str] = []
    cases = substitutions(path)
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        for where, body in cases:
            response = http.post(path, json=body)  # one connection: a reset after a response fails the next one
            problem = _problem(response, where, anthropic, null=_value_at(body, where) is None)
            if problem is not None:
                failures.append(f"{where} = {_value_at(body, where)!r:.60}: {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} substitutions:\n" + "\n".join(failures[:40])


def _problem(response: httpx.Response, where: str, anthropic: bool, *, null: bool) -> str | None:
    status = response.status_code
    if status >= 500:
        return f"{status} {response.text[:300]}"
    if status < 400:
        return None  # the other type is one the field takes too (null for an optional field, a list of stops)
    if response.headers.get("content-type") != "application/json":
        return f"{status} with {response.headers.get('content-type')}: {response.text[:200]}"
    body = response.json()
    if anthropic:
        error = body.get("error") if body.get("type") == "error" else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return f"{status} not in Anthropic's shape: {response.text[:300]}"
        quoted = re.findall(r"'([^']+)'", error["message"])
        paths = [
            p.rstrip(".") for p in re.findall(r"[A-Za-z_][\w.\[\]]*", error["message"]) if "[" in p or "." in p[:-1]
        ]
        named = quoted + paths
        if status == 400 and not any(_related(param, where, null) for param in named):
            return f"{status} names no related path: {error['message']}"
        return None
    error = body.get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"{status} not in OpenAI's shape: {response.text[:300]}"
    if status == 400 and not (isinstance(error["param"], str) and _related(error["param"], where, null)):
        return f"{status} param {error['param']!r}: {error['message']}"
    return None


def _value_at(body: dict[str, Any], where: str) -> Any:
    value: Any = body
    for part in re.findall(r"[^.\[\]]+", where):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value

"""Validation of responses and stream frames against JSON schemas derived from the official ``openai`` package.

The package's pydantic response types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``, ``Model``,
``ErrorObject``) give the fields, their types and enums. They give a None default to some fields that OpenAI's API
reference lists as required (and nullable): ``REQUIRED_NULLABLE`` puts those back into ``required``, so a response
that leaves out ``message.refusal`` or ``choices[].logprobs`` fails as it would against OpenAI's own spec. Nothing
is read from outside the repository.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import BaseModel

RESPONSE_TYPES: dict[str, type[BaseModel]] = {
    "CreateChatCompletionResponse": ChatCompletion,
    "CreateChatCompletionStreamResponse": ChatCompletionChunk,
    "CreateCompletionResponse": Completion,
    "Model": Model,
}
_LOGPROBS = ["content", "refusal", "content[].bytes", "refusal[].bytes", "content[].top_logprobs[].bytes"]
REQUIRED_NULLABLE: dict[str, list[str]] = {
    "CreateChatCompletionResponse": [
        "choices[].logprobs",
        "choices[].message.content",
        "choices[].message.refusal",
        *(f"choices[].logprobs.{path}" for path in _LOGPROBS),
    ],
    "CreateChatCompletionStreamResponse": [
        "choices[].finish_reason",
        *(f"choices[].logprobs.{path}" for path in _LOGPROBS),
    ],
    "CreateCompletionResponse": ["choices[].logprobs"],
    "Error": ["code", "param"],
}
"""Fields the API reference requires (with null allowed) where the package's models default them to None."""

NULL_FIRST: dict[str, list[str]] = {
    "CreateCompletionResponse": ["choices[].logprobs.token_logprobs", "choices[].logprobs.top_logprobs"],
}
"""Arrays whose first entry OpenAI's API sends as null where the package types it as a number or an object: under
``echo`` the first prompt token has no logprob (nothing precedes it), as OpenAI's legacy completions answer."""


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """The schema with every ``$ref`` replaced by a copy of its definition (the response types are not
    recursive), so paths can be followed without resolving references."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            resolved = _inline(defs[ref.rsplit("/", 1)[-1]], defs)
            return {**resolved, **{k: _inline(v, defs) for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


def _objects(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The object schemas a (possibly nullable) schema allows."""
    if "properties" in node:
        return [node]
    return [obj for branch in node.get("anyOf", ()) for obj in _objects(branch)]


def _arrays(node: dict[str, Any]) -> list[dict[str, Any]]:
    if node.get("type") == "array":
        return [node["items"]]
    return [items for branch in node.get("anyOf", ()) for items in _arrays(branch)]


def _require(schema: dict[str, Any], path: str) -> None:
    """Adds the last field of ``path`` (``choices[].message.refusal``) to the ``required`` list of its object."""
    parents, _, field = path.rpartition(".")
    nodes = _nodes(schema, parents) if parents else [schema]
    found = False
    for node in nodes:
        for obj in _objects(node):
            if field in obj["properties"]:
                obj["required"] = sorted({*obj.get("required", ()), field})
                found = True
    if not found:
        raise KeyError(f"{path} is not in the schema: the openai package's types changed")


def _nodes(schema: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """The schemas of the field at ``path`` (``choices[].logprobs.top_logprobs``), in every branch that has it."""
    nodes = [schema]
    for part in path.split("."):
        name, is_array = part.removesuffix("[]"), part.endswith("[]")
        nodes = [obj["properties"][name] for node in nodes for obj in _objects(node) if name in obj["properties"]]
        if is_array:
            nodes = [items for node in nodes for items in _arrays(node)]
    if not nodes:
        raise KeyError(f"{path} is not in the schema: the openai package's types changed")
    return nodes


def _null_first(schema: dict[str, Any], path: str) -> None:
    """Lets the first entry of the array at ``path`` be null (JSON Schema 2020-12 ``prefixItems``)."""
    arrays = [branch for node in _nodes(schema, path) for branch in (node, *node.get("anyOf", ()))]
    arrays = [node for node in arrays if node.get("type") == "array"]
    if not arrays:
        raise KeyError(f"{path} is not an array in the schema: the openai package's types changed")
    for node in arrays:
        node["prefixItems"] = [{"anyOf": [node["items"], {"type": "null"}]}]


def _schema(model: type[BaseModel], required: Sequence[str], null_first: Sequence[str] = ()) -> dict[str, Any]:
    raw = model.model_json_schema()
    schema = _inline(raw, raw.get("$defs", {}))
    for path in required:
        _require(schema, path)
    for path in null_first:
        _null_first(schema, path)
    return schema


@cache
def _schemas() -> dict[str, dict[str, Any]]:
    schemas = {
        name: _schema(model, REQUIRED_NULLABLE.get(name, []), NULL_FIRST.get(name, []))
        for name, model in RESPONSE_TYPES.items()
    }
    schemas["ListModelsResponse"] = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": schemas["Model"]}},
    }
    schemas["ErrorResponse"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": _schema(ErrorObject, REQUIRED_NULLABLE["Error"])},
    }
    # The API reference has no schema for streamed completions: OpenAI sends completion objects whose
    # finish_reason is null until the last one.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    for choice in _arrays(chunk["properties"]["choices"]):
        reason = choice["properties"]["finish_reason"]
        choice["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    schemas["CompletionChunk"] = chunk
    return schemas


class OpenAISchemas:
    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas

    @classmethod
    def load(cls) -> OpenAISchemas:
        return cls(_schemas())

    def check(self, name: str, instance: Any) -> None:
        """Raises ``jsonschema.ValidationError`` with the path of the first mismatch."""
        Draft202012Validator(self.schemas[name]).validate(instance)

    def check_completion_chunk(self, instance: Any) -> None:
        self.check("CompletionChunk", instance)

"""Checks on a client's JSON Schema before it becomes a constraint: well-formed, and small enough to compile.

A malformed schema, or one past the size limits, is a 400 naming where it is wrong rather than a failed request
later: the check is structural (keywords have the types JSON Schema gives them, local ``$ref`` pointers resolve,
patterns compile), not a full meta-schema validation. The limits keep a grammar's compile time bounded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from backends.deepseek.json_schema import pointer
from backends.deepseek.number_grammar import MAX_BOUND_DIGITS

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})

_SCHEMA_VALUED = (
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


MAX_SCHEMA_DEPTH = 64
"""Nesting of objects and arrays in a schema's JSON (a nested Pydantic model uses a handful): deeper is a 400,
checked without recursion before anything walks the schema."""

MAX_SCHEMA_BYTES = 256 * 1024
"""A constraint's schema (a ``json_schema`` format, or one forced tool's ``parameters``) as JSON text."""

MAX_BOUND = 10**MAX_BOUND_DIGITS
"""Numeric bounds must be below this (``number_grammar.MAX_BOUND_DIGITS``), in every constraint."""

MAX_ENUM_VALUES = 1000
"""``enum`` values in one constraint's schema, OpenAI's own limit for structured outputs."""


def check_json_schema(schema: Any, path: str = "schema") -> None:
    """Raise ``ValueError`` (with the path of the problem) if ``schema`` is not a well-formed JSON Schema."""
    _check_depth(schema, path)
    _check_schema(schema, path, schema)


class ConstraintLimitError(ValueError):
    """A schema past a limit of ``check_constraint_size``; ``path`` is where (for the error's ``param``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def check_constraint_size(schema: Any, path: str) -> None:
    """Raise ``ValueError`` (with the path of the problem) if ``schema`` (well-formed) is too large to compile
    into a constraint: the limits keep a grammar's compile time bounded (docs/deepseek.md)."""
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > MAX_SCHEMA_BYTES:
        message = f"the schema is {size} bytes of JSON; a constraint's schema may have at most {MAX_SCHEMA_BYTES}"
        raise ConstraintLimitError(path, message)
    values = 0
    pending: list[tuple[Any, str]] = [(schema, path)]
    while pending:
        node, where = pending.pop()
        if isinstance(node, Mapping):
            if isinstance(node.get("enum"), list):
                values += len(node["enum"])
            for key in _NUMBERS:
                bound = node.get(key)
                if isinstance(bound, int | float) and not isinstance(bound, bool) and abs(bound) >= MAX_BOUND:
                    raise ConstraintLimitError(
                        f"{where}.{key}", f"too large: bounds must be below 10**{MAX_BOUND_DIGITS}"
                    )
            pending.extend((child, f"{where}.{key}") for key, child in node.items() if isinstance(child, dict | list))
        elif isinstance(node, list):
            pending.extend((child, f"{where}[{i}]") for i, child in enumerate(node) if isinstance(child, dict | list))
    if values > MAX_ENUM_VALUES:
        message = f"the schema has {values} enum values; a constraint's schema may have at most {MAX_ENUM_VALUES}"
        raise ConstraintLimitError(path, message)


def _check_depth(schema: Any, path: str) -> None:
    pending: list[tuple[Any, int]] = [(schema, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, Mapping | list):
            if depth >= MAX_SCHEMA_DEPTH:
                raise ValueError(f"{path} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep")
            children = node.values() if isinstance(node, Mapping) else node
            pending.extend((child, depth + 1) for child in children)


def _check_schema(schema: Any, path: str, root: Any) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ValueError(f"{path} must be a JSON Schema object (or true/false), not {type(schema).__name__}")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise ValueError(f"{path}.type must be one of {', '.join(sorted(JSON_TYPES))} or a list of them")
    for key in _SCHEMA_VALUED:
        if key in schema:
            _check_schema(schema[key], f"{path}.{key}", root)
    if "items" in schema:
        items = schema["items"]
        if isinstance(items, list):  # draft 4-7 tuple form
            for i, item in enumerate(items):
                _check_schema(item, f"{path}.items[{i}]", root)
        else:
            _check_schema(items, f"{path}.items", root)
    for key in _SCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or not value:
                raise ValueError(f"{path}.{key} must be a non-empty list of schemas")
            for i, item in enumerate(value):
                _check_schema(item, f"{path}.{key}[{i}]", root)
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, Mapping):
                raise ValueError(f"{path}.{key} must be an object mapping names to schemas")
            for name, item in value.items():
                _check_schema(item, f"{path}.{key}.{name}", root)
    if "patternProperties" in schema:
        for pattern in schema["patternProperties"]:
            _check_pattern(pattern, f"{path}.patternProperties")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise ValueError(f"{path}.required must be a list of property names")
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        raise ValueError(f"{path}.enum must be a non-empty list")
    if "pattern" in schema:
        _check_pattern(schema["pattern"], f"{path}.pattern")
    for key in _COUNTS:
        value = schema.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{path}.{key} must be a non-negative integer")
    for key in _NUMBERS:
        value = schema.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise ValueError(f"{path}.{key} must be a number")
    if isinstance(schema.get("multipleOf"), int | float) and schema["multipleOf"] <= 0:
        raise ValueError(f"{path}.multipleOf must be greater than 0")
    if "$ref" in schema:
        _check_ref(schema["$ref"], f"{path}.$ref", root)


def _check_pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"{path} must be a regular expression string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{path} does not compile: {exc}") from None


_NOWHERE = object()


def _check_ref(ref: Any, path: str, root: Any) -> None:
    """Only local references can be compiled (no schema is ever fetched): they must point into the schema."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"{path} must be a local reference such as '#/$defs/Name'")
    if ref != "#" and not ref.startswith("#/"):
        raise ValueError(f"{path} {ref!r} is not a JSON pointer")
    if pointer(root, ref, missing=_NOWHERE) is _NOWHERE:
        raise ValueError(f"{path} {ref!r} points at nothing in the schema")

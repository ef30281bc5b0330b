"""A call's DSML parameters become JSON arguments of the types the tool declares, as DeepSeek's parser makes them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.deepseek.arguments import arguments_json
from backends.deepseek.json_schema import schema_types


def param(name: str, value: str, string: bool = True) -> str:
    return f'<｜DSML｜ parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜ parameter>'


def args(raw: str, parameters: dict[str, Any] | None) -> Any:
    return json.loads(arguments_json(raw, parameters))


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


@pytest.mark.parametrize(
    ("schema", "text", "expected"),
    [
        ({"type": "integer"}, "2", 2),
        ({"type": "integer"}, " 7 ", 7),
        ({"type": "integer"}, "2.0", 2),
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "number"}, "3", 3),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, "false", False),
        ({"type": "null"}, "null", None),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": "array"}, "[1, 2]", [1, 2]),
        ({"type": "object"}, '{"a": 1}', {"a": 1}),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"const": True}, "true", True),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
        ({"type": "integer"}, "two", "two"),  # nothing it could be: left as the model wrote it
        ({"type": "number"}, "NaN", "NaN"),
        ({"type": "string"}, "2", "2"),
        ({"type": ["string", "integer"]}, "2", "2"),  # a string is allowed: the model's string stays a string
        ({}, "2", "2"),
    ],
)
def test_string_true_value_takes_the_declared_type(schema: dict[str, Any], text: str, expected: Any) -> None:
    assert args(param("x", text), obj(x=schema)) == {"x": expected}


@pytest.mark.parametrize(
    ("schema", "text", "expected"),
    [
        ({"type": "string"}, "5", "5"),
        ({"type": "string"}, "true", "true"),
        ({"type": "string"}, "[1, 2]", "[1, 2]"),
        ({"type": "string"}, '{"k": null}', '{"k": null}'),
        ({"type": "integer"}, "5.0", 5),
        ({"type": "number"}, "5", 5),
        ({"type": "integer"}, "true", True),  # no string allowed, nothing to convert to: unchanged
        ({"enum": ["a", "1"]}, "1", "1"),
    ],
)
def test_json_value_of_a_refused_type_becomes_text_where_strings_are_allowed(
    schema: dict[str, Any], text: str, expected: Any
) -> None:
    assert args(param("x", text, string=False), obj(x=schema)) == {"x": expected}


def test_nested_objects_arrays_and_refs_are_corrected_member_by_member() -> None:
    parameters = {
        "type": "object",
        "properties": {
            "trip": {"$ref": "#/$defs/Trip"},
            "stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}},
        },
        "$defs": {
            "Trip": {"type": "object", "properties": {"days": {"type": "integer"}, "code": {"type": "string"}}},
            "Stop": {"type": "object", "properties": {"order": {"type": "integer"}, "name": {"type": "string"}}},
        },
    }
    raw = param("trip", '{"days": "3", "code": 7}', False) + param("stops", '[{"order": "1", "name": 2}]', False)
    assert args(raw, parameters) == {"trip": {"days": 3, "code": "7"}, "stops": [{"order": 1, "name": "2"}]}


def test_undeclared_tool_or_parameter_keeps_the_marked_types() -> None:
    raw = param("days", "2") + param("n", "3", False)
    assert args(raw, None) == {"days": "2", "n": 3}
    assert args(raw, obj(city={"type": "string"})) == {"days": "2", "n": 3}


def test_a_parameter_whose_schema_names_no_type_keeps_the_value_the_model_wrote() -> None:
    """A deliberate difference from DeepSeek's parser, which reads such a parameter as a string and turns a JSON
    value into its text: nothing in the schema asks for text (docs/deepseek.md)."""
    raw = param("n", "3", False) + param("o", '{"k": [1]}', False) + param("s", "3")
    assert args(raw, obj(n={}, o={"description": "anything"}, s={})) == {"n": 3, "o": {"k": [1]}, "s": "3"}


def test_unwrapped_arguments_are_corrected_too() -> None:
    raw = param("arguments", '{"city": "Rome", "days": "4"}', False)
    assert args(raw, obj(city={"type": "string"}, days={"type": "integer"})) == {"city": "Rome", "days": 4}


def test_schema_types_reads_types_enums_branches_and_refs() -> None:
    root = {"$defs": {"N": {"type": "integer"}}}
    assert schema_types({"type": "string"}, root) == {"string"}
    assert schema_types({"enum": ["a", None]}, root) == {"string", "null"}
    assert schema_types({"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}, root) == {"integer", "null"}
    assert schema_types({"type": "number"}, root) == {"number", "integer"}
    assert schema_types({"anyOf": [{"type": "string"}, {}]}, root) is None
    assert schema_types({"description": "anything"}, root) is None

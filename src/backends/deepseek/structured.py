"""Constrained decoding for DeepSeek V4.1 on DeepInfer's engine API: ``response_format`` and forced tool calls.

Everything here produces DeepInfer ``so_args`` (``reference/deepinfer-engine.md`` section D): a ``schema_type``
(``json`` | ``regex`` | ``ebnf``) and its ``schema`` string. The chat template adds ``trigger_token_ids`` (the
ids of ``</think>``) in thinking mode so the reasoning stays free and the grammar starts after it.

Grammars are GBNF (llama.cpp's dialect, which xgrammar reads and llguidance translates): rule names use letters,
digits and dashes only, and nothing beyond plain GBNF is used.

Schemas are checked here before they reach the engine, so a malformed one is a 400 naming ``response_format``
rather than a failed request later: the check is structural (keywords have the types JSON Schema gives them,
local ``$ref`` pointers resolve, patterns compile), not a full meta-schema validation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from backends.deepseek.encoding import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
)

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "ebnf")
"""``regex`` and ``ebnf`` are this gateway's extensions: ``{"type": "regex", "regex": "..."}`` and
``{"type": "ebnf", "ebnf": "root ::= ..."}``."""

ANY_JSON_OBJECT = {"type": "object", "additionalProperties": True}
"""``json_object``: any object. ``additionalProperties`` is explicit because DeepInfer compiles schemas in
xgrammar's strict mode, where a bare ``{"type": "object"}`` allows only ``{}``."""

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})

# ---- response_format -------------------------------------------------------------------------------------


def response_format_so_args(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``so_args`` (without trigger) for an OpenAI ``response_format``; None for text.

    Raises ``ValueError`` naming what is wrong when the format or its schema is malformed.
    """
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema_type": "json", "schema": json.dumps(ANY_JSON_OBJECT)}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'name' and a 'schema'")
        schema = spec.get("schema", ANY_JSON_OBJECT)
        check_json_schema(schema, "response_format.json_schema.schema")
        return {"schema_type": "json", "schema": json.dumps(schema, ensure_ascii=False)}
    if kind == "regex":
        pattern = response_format.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format.regex must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"response_format.regex does not compile: {exc}") from None
        return {"schema_type": "regex", "schema": pattern}
    if kind == "ebnf":
        grammar = response_format.get("ebnf")
        if not isinstance(grammar, str) or not _ROOT_RULE.search(grammar):
            raise ValueError("response_format.ebnf must be a GBNF grammar string with a 'root ::= ...' rule")
        return {"schema_type": "ebnf", "schema": grammar}
    raise ValueError(
        f"response_format.type {kind!r} is not supported; expected one of {', '.join(RESPONSE_FORMAT_TYPES)}"
    )


_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)

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


def check_json_schema(schema: Any, path: str = "schema") -> None:
    """Raise ``ValueError`` (with the path of the problem) if ``schema`` is not a well-formed JSON Schema."""
    _check_schema(schema, path, schema)


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


def _check_ref(ref: Any, path: str, root: Any) -> None:
    """Only local references can be compiled (no schema is ever fetched): they must point into the schema."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"{path} must be a local reference such as '#/$defs/Name'")
    node = root
    pointer = ref[1:]
    if not pointer:
        return
    if not pointer.startswith("/"):
        raise ValueError(f"{path} {ref!r} is not a JSON pointer")
    for raw in pointer[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"{path} {ref!r} points at nothing in the schema")


# ---- forced tool calls -----------------------------------------------------------------------------------


def tool_call_grammar(functions: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """A GBNF grammar for a DSML tool-call block calling one (or, with ``parallel``, several) of ``functions``.

    ``functions`` are OpenAI function objects (``name``, ``parameters``). The block is written as the encoder
    renders history: ``\\n\\n<｜DSML｜ calls>\\n``, invokes joined by ``\\n``, ``\\n</｜DSML｜ calls>``. Within a
    call, parameters come in the order the schema declares them, required ones always, optional ones at most
    once, and no others; string-typed values are raw text (``string="true"``, never containing ``</``), other
    types JSON of that type (``string="false"``). Deeper JSON structure is free-form JSON, not schema-checked.
    """
    if not functions:
        raise ValueError("a forced tool call needs at least one tool")
    rules: list[str] = []
    call_names = []
    for i, function in enumerate(functions):
        name = function["name"]
        call = f"call-{i}"
        call_names.append(call)
        params = _parameter_rules(call, function.get("parameters"), rules)
        head = _literal(f'{DSML_INVOKE_START}{name}">')
        rules.append(f"{call} ::= {head} {params} {_literal(chr(10) + DSML_INVOKE_END)}")
    calls_open = _literal("\n\n" + DSML_CALLS_START + "\n")
    calls_close = _literal("\n" + DSML_CALLS_END)
    head_rules = [
        f"root ::= {calls_open} call{' next-call*' if parallel else ''} {calls_close}",
        f"call ::= {' | '.join(call_names)}",
        'next-call ::= "\\n" call',
    ]
    return "\n".join(head_rules + rules + _SHARED_RULES) + "\n"


def _parameter_rules(call: str, parameters: Any, rules: list[str]) -> str:
    """Adds one rule per declared parameter; returns the expression for the call's parameter list."""
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        return '"\\n"'  # no parameters: the encoder renders an empty line
    required = parameters.get("required") or ()
    parts = []
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"{call}-p{j}"
        rules.append(f'{rule} ::= "\\n" {_parameter_value(key, schema)}')
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts)


def _parameter_value(key: str, schema: Any) -> str:
    """Alternatives for one parameter: its tag with ``string="true"`` raw text or ``string="false"`` JSON."""
    kinds = _types_of(schema)
    enum = schema.get("enum") if isinstance(schema, Mapping) else None
    string_form: str | None = None
    json_forms: list[str] = []
    if isinstance(enum, list) and enum:
        strings = [v for v in enum if isinstance(v, str)]
        others = [v for v in enum if not isinstance(v, str)]
        if strings:
            string_form = " | ".join(_literal(v) for v in strings)
        json_forms = [_literal(json.dumps(v, ensure_ascii=False)) for v in others]
    else:
        if kinds is None or "string" in kinds:
            string_form = "dsml-string"
        for kind in sorted(kinds or ()):
            if kind != "string":
                json_forms.append(_JSON_OF_TYPE[kind])
        if kinds is None:
            json_forms.append("json-value")
    open_tag = f'{DSML_PARAMETER_START}{key}" string='
    alternatives = []
    if string_form is not None:
        alternatives.append(f"{_literal(open_tag + chr(34) + 'true' + chr(34) + '>')} ({string_form})")
    if json_forms:
        alternatives.append(f"{_literal(open_tag + chr(34) + 'false' + chr(34) + '>')} ({' | '.join(json_forms)})")
    return f"({' | '.join(alternatives)}) {_literal(DSML_PARAMETER_END)}"


def _types_of(schema: Any) -> set[str] | None:
    """The JSON types a property schema allows, None when it does not say (anyOf, $ref, no type...)."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, str) and kind in JSON_TYPES:
        return {kind}
    if isinstance(kind, list) and kind and all(k in JSON_TYPES for k in kind):
        return set(kind)
    return None


_JSON_OF_TYPE = {
    "number": "json-number",
    "integer": "json-int",
    "boolean": '("true" | "false")',
    "null": '"null"',
    "object": "json-object",
    "array": "json-array",
}

JSON_DEPTH = 4
"""Nesting depth of JSON values in forced tool-call arguments. Bounded so that every rule is non-recursive:
grammar libraries with a lexer (llguidance) then compile each parameter to one regular token."""


def _json_rules(depth: int) -> list[str]:
    rules = ['json-value-0 ::= json-string | json-number | "true" | "false" | "null"']
    for d in range(1, depth + 1):
        inner = f"json-value-{d - 1}"
        member = f'json-string ws ":" ws {inner} ws'
        rules += [
            f'json-object-{d} ::= "{{" ws ({member} ("," ws {member})*)? "}}"',
            f'json-array-{d} ::= "[" ws ({inner} ws ("," ws {inner} ws)*)? "]"',
            f"json-value-{d} ::= {inner} | json-object-{d} | json-array-{d}",
        ]
    return [
        *rules,
        f"json-value ::= json-value-{depth}",
        f"json-object ::= json-object-{depth}",
        f"json-array ::= json-array-{depth}",
    ]


_SHARED_RULES = [
    'dsml-string ::= ([^<] | "<"+ [^</])* "<"*',
    *_json_rules(JSON_DEPTH),
    'json-string ::= "\\"" ([^"\\\\\\x00-\\x1f] | "\\\\" (["\\\\/bfnrt] | "u" hex hex hex hex))* "\\""',
    "hex ::= [0-9a-fA-F]",
    'json-number ::= json-int ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    'json-int ::= "-"? ("0" | [1-9] [0-9]*)',
    'ws ::= " "?',
]


def _literal(text: str) -> str:
    """A GBNF string literal for ``text``."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)

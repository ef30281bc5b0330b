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

from backends.deepseek.arguments import pointer, schema_types
from backends.deepseek.encoding import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
)
from backends.deepseek.gbnf import literal, repeat, text_literal
from backends.deepseek.json_grammar import BASE_RULES, MAX_BOUND_DIGITS, SchemaGrammar, json_value_rules
from backends.deepseek.regex_grammar import string_shape

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
        check_constraint_size(schema, "response_format.json_schema.schema")
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


MAX_SCHEMA_DEPTH = 64
"""Nesting of objects and arrays in a schema's JSON (a nested Pydantic model uses a handful): deeper is a 400,
checked without recursion before anything walks the schema."""

MAX_SCHEMA_BYTES = 256 * 1024
"""A constraint's schema (a ``json_schema`` format, or one forced tool's ``parameters``) as JSON text."""

MAX_BOUND = 10**MAX_BOUND_DIGITS
"""Numeric bounds must be below this (``json_grammar.MAX_BOUND_DIGITS``), in every constraint."""

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


# ---- forced tool calls -----------------------------------------------------------------------------------


class ToolSchemaError(ValueError):
    """A tool's ``parameters`` schema cannot be compiled; ``index`` is the tool's position in ``functions``, and
    ``where`` the path of the part that cannot, below ``parameters`` (``properties.city``; "" for the whole)."""

    def __init__(self, index: int, message: str, where: str = "") -> None:
        super().__init__(message)
        self.index = index
        self.where = where


class _ParameterError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def tool_call_grammar(functions: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """A GBNF grammar for a DSML tool-call block calling one (or, with ``parallel``, several) of ``functions``.

    ``functions`` are OpenAI function objects (``name``, ``parameters``). The block is written as the encoder
    renders history: ``\\n\\n<｜DSML｜ calls>\\n``, invokes joined by ``\\n``, ``\\n</｜DSML｜ calls>``. Within a
    call, parameters come in the order the schema declares them, required ones always, optional ones at most
    once, and no others. Each value follows its parameter's sub-schema (``json_grammar``): as raw text
    (``string="true"``) where the sub-schema allows strings, as JSON (``string="false"``) where it allows other
    values. Raw text never contains ``</`` nor ends in ``<`` (bounded or enumerated text has no ``<`` at all), so
    a value cannot run into its closing tag.

    Raises ``ToolSchemaError`` (naming the tool and parameter) for a schema that cannot be compiled or that
    nothing satisfies.
    """
    if not functions:
        raise ValueError("a forced tool call needs at least one tool")
    rules: list[str] = []
    call_names = []
    for i, function in enumerate(functions):
        name = function["name"]
        call = f"call-{i}"
        call_names.append(call)
        try:
            params = _parameter_rules(call, function.get("parameters"), rules)
        except _ParameterError as exc:
            raise ToolSchemaError(i, str(exc), f"properties.{exc.key}") from None
        except ValueError as exc:
            raise ToolSchemaError(i, str(exc)) from None
        head = literal(f'{DSML_INVOKE_START}{name}">')
        rules.append(f"{call} ::= {head} {params} {literal(chr(10) + DSML_INVOKE_END)}")
    calls_open = literal("\n\n" + DSML_CALLS_START + "\n")
    calls_close = literal("\n" + DSML_CALLS_END)
    head_rules = [
        f"root ::= {calls_open} call{' next-call*' if parallel else ''} {calls_close}",
        f"call ::= {' | '.join(call_names)}",
        'next-call ::= "\\n" call',
    ]
    return "\n".join(head_rules + rules + _SHARED_RULES) + "\n"


def _parameter_rules(call: str, parameters: Any, rules: list[str]) -> str:
    """Adds one rule per declared parameter; returns the expression for the call's parameter list."""
    if parameters is None:
        return '"\\n"'
    grammar = SchemaGrammar(parameters, call, rules)
    schema = grammar.resolve(parameters)
    if isinstance(schema, Mapping) and "allOf" in schema:
        schema = grammar.merged(schema)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        return '"\\n"'  # no parameters: the encoder renders an empty line
    required = schema.get("required") or ()
    parts = []
    for j, (key, sub) in enumerate(properties.items()):
        rule = f"{call}-p{j}"
        try:
            value = _parameter_value(grammar, key, sub)
        except ValueError as exc:
            raise _ParameterError(key, str(exc)) from None
        rules.append(f'{rule} ::= "\\n" {value}')
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts)


def _parameter_value(grammar: SchemaGrammar, key: str, schema: Any) -> str:
    """Alternatives for one parameter: its tag with ``string="true"`` raw text and/or ``string="false"`` JSON."""
    raw = _raw_value(grammar, schema)
    types = schema_types(schema, grammar.root)
    wants_json = raw is None or types is None or bool(types - {"string"})
    open_tag = f'{DSML_PARAMETER_START}{key}" string='
    alternatives = []
    if raw is not None:
        alternatives.append(f"{literal(open_tag + chr(34) + 'true' + chr(34) + '>')} {raw}")
    if wants_json:
        alternatives.append(f"{literal(open_tag + chr(34) + 'false' + chr(34) + '>')} {grammar.value(schema)}")
    return f"({' | '.join(alternatives)}) {literal(DSML_PARAMETER_END)}"


def _raw_value(grammar: SchemaGrammar, schema: Any) -> str | None:
    """Raw text (``string="true"``) for the strings ``schema`` allows, None when it allows none writable so."""
    schema = grammar.resolve(schema)
    if schema is True:
        return "dsml-string"
    if not isinstance(schema, Mapping):
        return None
    if "allOf" in schema:
        schema = grammar.merged(schema)
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [text_literal(v) for v in values if isinstance(v, str) and "<" not in v]
        return f"({' | '.join(f'({t})' for t in texts)})" if texts else None
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            texts = [t for t in (_raw_value(grammar, branch) for branch in schema[key]) if t is not None]
            return f"({' | '.join(texts)})" if texts else None
    types = grammar.types(schema)
    if types is not None and "string" not in types:
        return None
    if "pattern" in schema or "format" in schema:
        shaped = string_shape(schema, "raw")
        if shaped is not None or "pattern" in schema:
            return shaped  # None: the pattern needs a '<', so the value is written as JSON
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not low and high is None:
        return "dsml-string"
    return repeat("dsml-char", low, high)


_SHARED_RULES = [
    'dsml-string ::= [^<]* ("<"+ [^</] [^<]*)*',  # no "</", no trailing "<"; one run per piece: xgrammar masks it in us
    "dsml-char ::= [^<]",
    *BASE_RULES,
    *json_value_rules(),
]

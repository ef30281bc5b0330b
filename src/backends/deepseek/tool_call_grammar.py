"""Forced tool calls for DeepSeek V4.1: a GBNF grammar for the DSML block that calls one of the forced tools.

The grammar goes to the engine as ``so_args`` ``{"schema_type": "ebnf", ...}`` (``reference/deepinfer-engine.md``
section D). Grammars are GBNF (llama.cpp's dialect, which xgrammar reads and llguidance translates): rule names use
letters, digits and dashes only, and nothing beyond plain GBNF is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from backends.deepseek.gbnf import literal, repeat, text_literal
from backends.deepseek.json_grammar import BASE_RULES, SchemaGrammar, json_value_rules
from backends.deepseek.json_schema import schema_types
from backends.deepseek.markers import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
)
from backends.deepseek.regex_grammar import string_shape


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

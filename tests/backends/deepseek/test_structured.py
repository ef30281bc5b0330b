"""so_args for response_format and forced tool calls: schemas checked up front, grammars that compile and accept
exactly the DSML blocks the encoder renders (checked with llguidance, the reference engine's grammar library)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from backends.deepseek.response_format import response_format_so_args
from backends.deepseek.schema_checks import check_json_schema
from backends.deepseek.tool_call_grammar import tool_call_grammar
from backends.reference import ReferenceArtifacts
from backends.reference.structured import tokenizer_within_vocab

from .dsml_text import ToolCall, render_tool_calls

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"enum": ["c", "f"]},
            "detailed": {"type": "boolean"},
        },
        "required": ["city"],
    },
}
SEARCH = {
    "name": "search",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"}, "any": {}},
    },
}
NO_ARGS = {"name": "now"}


class Grammar:
    """A compiled GBNF grammar that tells whether it accepts a whole text (as the engine would see it)."""

    def __init__(self, gbnf: str, artifacts: ReferenceArtifacts) -> None:
        self.tokenizer = artifacts.tokenizer
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer_within_vocab(artifacts.tokenizer, artifacts.model.vocab_size),
            n_vocab=artifacts.model.vocab_size,
            eos_token=1,
        )
        self.grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.grammar, self.ll_tokenizer)
        assert not is_error, messages

    def accepts(self, text: str) -> bool:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def calls(*items: tuple[str, dict[str, Any]]) -> str:
    return render_tool_calls([ToolCall("", name, args) for name, args in items])


def test_forced_call_grammar_accepts_rendered_calls_of_declared_tools(artifacts: ReferenceArtifacts) -> None:
    grammar = Grammar(tool_call_grammar([WEATHER, SEARCH, NO_ARGS], parallel=True), artifacts)
    assert grammar.accepts(calls(("get_weather", {"city": "Paris", "days": 2})))
    assert grammar.accepts(calls(("get_weather", {"city": "a < b <<c", "unit": "f", "detailed": True})))
    assert grammar.accepts(calls(("search", {"q": "x", "filters": {"k": [1, {"n": None}]}, "tags": [], "any": 1.5})))
    assert grammar.accepts(calls(("search", {"any": "free text"})))
    assert grammar.accepts(calls(("now", {})))
    assert grammar.accepts(calls(("get_weather", {"city": "Oslo"}), ("now", {}), ("search", {"q": "y"})))


def test_forced_call_grammar_rejects_what_the_tools_do_not_declare(artifacts: ReferenceArtifacts) -> None:
    grammar = Grammar(tool_call_grammar([WEATHER, SEARCH], parallel=True), artifacts)
    assert not grammar.accepts(calls(("unknown", {"city": "Paris"})))
    assert not grammar.accepts(calls(("get_weather", {"days": 2})))  # city is required
    assert not grammar.accepts(calls(("get_weather", {"city": "Paris", "country": "FR"})))
    assert not grammar.accepts(calls(("get_weather", {"city": "Paris", "days": "two"})))
    assert not grammar.accepts(calls(("get_weather", {"city": "Paris", "unit": "k"})))
    assert not grammar.accepts(calls(("get_weather", {"days": 1, "city": "Paris"})))  # declared order
    assert not grammar.accepts(calls(("get_weather", {"city": "a</b"})))
    assert not grammar.accepts("plain text answer")


def test_enum_text_with_a_tag_opening_is_never_written_as_raw_text(artifacts: ReferenceArtifacts) -> None:
    """Raw text holding ``</`` would run into its closing tag: such an enum value is not offered as raw text."""
    tool = {"name": "pick", "parameters": {"type": "object", "properties": {"v": {"enum": ["a</b", "c"]}}}}
    grammar = Grammar(tool_call_grammar([tool], parallel=False), artifacts)
    assert grammar.accepts(calls(("pick", {"v": "c"})))
    assert not grammar.accepts(calls(("pick", {"v": "a</b"})))


def test_single_call_grammar_refuses_a_second_call(artifacts: ReferenceArtifacts) -> None:
    grammar = Grammar(tool_call_grammar([WEATHER], parallel=False), artifacts)
    assert grammar.accepts(calls(("get_weather", {"city": "Paris"})))
    assert not grammar.accepts(calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})))


def test_json_object_allows_any_object_even_under_strict_mode() -> None:
    so_args = response_format_so_args({"type": "json_object"})
    assert so_args is not None and so_args["schema_type"] == "json"
    assert json.loads(so_args["schema"]) == {"type": "object", "additionalProperties": True}


def test_json_schema_regex_and_ebnf_become_so_args() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    so_args = response_format_so_args({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert so_args == {"schema_type": "json", "schema": json.dumps(schema)}
    assert response_format_so_args({"type": "regex", "regex": "[a-z]+"}) == {"schema_type": "regex", "schema": "[a-z]+"}
    grammar = 'root ::= "yes" | "no"'
    assert response_format_so_args({"type": "ebnf", "ebnf": grammar}) == {"schema_type": "ebnf", "schema": grammar}
    assert response_format_so_args({"type": "text"}) is None
    assert response_format_so_args(None) is None


@pytest.mark.parametrize(
    ("response_format", "fragment"),
    [
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "dict"}}}, "schema.type"),
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": []}}, "schema must be"),
        ({"type": "regex", "regex": "(unclosed"}, "regex does not compile"),
        ({"type": "ebnf", "ebnf": 'start ::= "x"'}, "root"),
        ({"type": "yaml"}, "not supported"),
    ],
)
def test_malformed_response_formats_raise_naming_the_problem(response_format: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        response_format_so_args(response_format)


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"properties": {"a": {"type": "strin"}}}, "schema.properties.a.type"),
        ({"required": "a"}, "schema.required"),
        ({"anyOf": []}, "schema.anyOf"),
        ({"items": {"minItems": -1}}, "schema.items.minItems"),
        ({"pattern": "(["}, "schema.pattern"),
        ({"$ref": "#/$defs/Missing", "$defs": {}}, "schema.$ref"),
        ({"$ref": "https://example.com/s.json"}, "schema.$ref"),
        ({"enum": []}, "schema.enum"),
        ({"multipleOf": 0}, "schema.multipleOf"),
    ],
)
def test_schema_check_names_the_path_of_the_problem(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(ValueError, match=f"^{where.replace('$', '[$]')}"):
        check_json_schema(schema)


def test_schema_check_accepts_well_formed_schemas() -> None:
    check_json_schema(
        {
            "$defs": {"Item": {"type": ["string", "null"], "maxLength": 5}},
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
                "n": {"type": "number", "minimum": 0, "multipleOf": 0.5},
                "tag": {"anyOf": [{"const": "a"}, {"pattern": "^b+$"}]},
            },
            "required": ["items"],
            "additionalProperties": False,
        }
    )
    check_json_schema(True)


def test_refs_with_escaped_pointer_characters_resolve() -> None:
    """JSON pointers spell ``/`` as ``~1`` and ``~`` as ``~0`` (RFC 6901): such refs point at their definitions."""
    schema = {
        "$defs": {"a/b": {"type": "string"}, "c~d": {"type": "integer"}},
        "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/c~0d"}},
    }
    check_json_schema(schema, "s")
    with pytest.raises(ValueError, match="points at nothing"):
        check_json_schema({**schema, "properties": {"x": {"$ref": "#/$defs/a/b"}}}, "s")

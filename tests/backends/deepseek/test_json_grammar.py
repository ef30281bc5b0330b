"""JSON Schema compiled to GBNF (for forced tool calls) accepts what the engines' JSON compiler accepts.

Every case runs both compilers on the reference engine's grammar library (llguidance): ours, through the
GBNF -> Lark translation the engine uses for ``ebnf``, and llguidance's own JSON-schema compiler in the strict
mode ``response_format`` gets. On the listed cases the two must agree on every sample value; on random schemas
ours must never accept a value the schema forbids. (It may refuse a few valid ones there: the engine lexes GBNF
terminals by longest match, so where two ``anyOf`` branches start alike the longer terminal can cut the other
branch off. xgrammar, DeepInfer's grammar engine, matches character by character and has no such effect.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from llguidance.gbnf_to_lark import gbnf_to_lark

from backends.deepseek.json_grammar import BASE_RULES, SchemaGrammar, json_value_rules
from backends.deepseek.number_grammar import integer_range
from backends.deepseek.regex_grammar import pattern_expression
from backends.reference import ReferenceArtifacts
from backends.reference.strict_schema import strict_json_schema
from backends.reference.structured import JSON_OPTIONS, tokenizer_within_vocab

_LL_TOKENIZERS: dict[int, llguidance.LLTokenizer] = {}


def ll_tokenizer(artifacts: ReferenceArtifacts) -> llguidance.LLTokenizer:
    """llguidance's view of the reference tokenizer, built once per session (~40 ms)."""
    key = id(artifacts.tokenizer)
    if key not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[key] = llguidance.LLTokenizer(
            tokenizer_within_vocab(artifacts.tokenizer, artifacts.model.vocab_size),
            n_vocab=artifacts.model.vocab_size,
            eos_token=1,
        )
    return _LL_TOKENIZERS[key]


class Acceptor:
    """Whether a compiled grammar accepts a whole text, fed as the reference tokenizer splits it."""

    def __init__(self, grammar: str, artifacts: ReferenceArtifacts) -> None:
        self.tokenizer = artifacts.tokenizer
        self.ll_tokenizer = ll_tokenizer(artifacts)
        self.grammar = grammar
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        assert not is_error, messages

    def __call__(self, text: str) -> bool:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def ours(schema: Any, artifacts: ReferenceArtifacts) -> Acceptor:
    rules: list[str] = []
    value = SchemaGrammar(schema, "s", rules).value(schema)
    gbnf = "\n".join([f"root ::= {value}", *rules, *BASE_RULES, *json_value_rules()])
    return Acceptor(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf)), artifacts)


def engines(schema: Any, artifacts: ReferenceArtifacts) -> Acceptor:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_json_schema(schema), overrides=JSON_OPTIONS)
    return Acceptor(grammar, artifacts)


NESTED = {
    "$defs": {
        "Unit": {"enum": ["c", "f"]},
        "Place": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"$ref": "#/$defs/Unit"},
                "zoom": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["city"],
        },
        "Tree": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}},
            "required": ["v"],
        },
    },
    "type": "object",
    "properties": {
        "dest": {"$ref": "#/$defs/Place"},
        "via": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
        "mode": {"const": "fast"},
        "score": {"type": "number", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "maxItems": 2},
        "tree": {"$ref": "#/$defs/Tree"},
    },
    "required": ["dest", "mode"],
}

CASES: list[tuple[Any, list[Any]]] = [
    ({"type": "integer", "minimum": 1, "maximum": 5}, [0, 1, 3, 5, 6, -1, 10, 2.5, "3"]),
    ({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 12}, [-4, -3, -2, 0, 11, 12, 100]),
    ({"type": "integer", "minimum": 95}, [94, 95, 99, 100, 1234, -95]),
    ({"type": "integer", "maximum": -7}, [-6, -7, -70, 0, 7]),
    ({"type": "number", "minimum": 1, "maximum": 5}, [0, 0.5, 1, 1.5, 4.99, 5, 5.5, 6, -2]),
    ({"type": "number", "minimum": -2.5, "exclusiveMaximum": 0}, [-3, -2, -1.25, -0.5, 0, 0.5]),
    ({"type": "string", "maxLength": 3}, ["", "ab", "abc", "abcd", 'a"b', "\\n"]),
    ({"type": "string", "minLength": 2, "maxLength": 2}, ["a", "ab", "abc"]),
    ({"enum": ["red", 2, None]}, ["red", 2, None, "blue", 3]),
    ({"const": {"k": [1, 2]}}, [{"k": [1, 2]}, {"k": [1]}]),
    ({"anyOf": [{"type": "integer", "maximum": 0}, {"type": "string", "maxLength": 1}]}, [-1, 1, "a", "ab", None]),
    ({"type": ["boolean", "null"]}, [True, None, 0, "true"]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}, [[], [1], [1, 2, 3], [1, 2, 3, 4]]),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, [["a", 1], ["a"], [1, "a"]]),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]},
        [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1}, {}, {"b": "x", "c": 1}, {"b": 1}],
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}},
        [{}, {"a": 1}, {"a": 1, "z": True}, {"z": False}, {"z": 1}],
    ),
    (
        {  # how Pydantic v1 wrote a field of a model type with a description
            "$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
            "type": "object",
            "properties": {"p": {"allOf": [{"$ref": "#/$defs/P"}], "description": "a P"}},
        },
        [{"p": {"a": 1}}, {}, {"p": {"b": 1}}, {"p": {}}],
    ),
    # a constant must not cut off a free value that begins the same way (the reference engine's lexer)
    ({"anyOf": [{"const": "ab"}, {"type": "string", "maxLength": 4}]}, ["ab", "abc", "a", "abcde"]),
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"const": -13}]}}, [[-12, -13], [-130], ["x"]]),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        [{"ab": "x"}, {"a": 1, "ab": "x"}, {"a": "x"}, {"b": 1}],
    ),
    (
        NESTED,
        [
            {"dest": {"city": "Oslo"}, "mode": "fast"},
            {"dest": {"city": "Oslo", "unit": "c", "zoom": 20}, "via": None, "mode": "fast", "score": 4.5},
            {"dest": {"city": "Oslo"}, "via": {"city": "Rome", "zoom": 3}, "mode": "fast", "tags": ["a", "bcd"]},
            {"dest": {"city": "Oslo"}, "mode": "fast", "tree": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}},
            {"dest": {"city": "Oslo"}, "mode": "slow"},
            {"dest": {"city": "Amsterdam"}, "mode": "fast"},
            {"dest": {"city": "Oslo", "unit": "k"}, "mode": "fast"},
            {"dest": {"city": "Oslo", "zoom": 0}, "mode": "fast"},
            {"dest": {"city": "Oslo"}, "mode": "fast", "score": 0},
            {"dest": {"city": "Oslo"}, "mode": "fast", "tags": ["abcd"]},
            {"dest": {"city": "Oslo"}, "mode": "fast", "tags": ["a", "b", "c"]},
            {"dest": {"city": "Oslo"}, "mode": "fast", "tree": {"kids": []}},
            {"mode": "fast"},
        ],
    ),
]


@pytest.mark.parametrize(("schema", "values"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_compiled_schema_agrees_with_the_engines_json_compiler(
    schema: Any, values: list[Any], artifacts: ReferenceArtifacts
) -> None:
    mine, theirs = ours(schema, artifacts), engines(schema, artifacts)
    verdicts = [(value, mine(json.dumps(value)), theirs(json.dumps(value))) for value in values]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert any(accepted for _, accepted, _ in verdicts) and not all(accepted for _, accepted, _ in verdicts)


def test_objects_and_arrays_without_declarations_hold_any_json(artifacts: ReferenceArtifacts) -> None:
    accepts = ours({"type": "object", "properties": {"o": {"type": "object"}, "a": {"type": "array"}}}, artifacts)
    assert accepts(json.dumps({"o": {"x": [1, {"y": None}]}, "a": [1, "b", {}]}))
    assert not accepts(json.dumps({"o": [], "a": {}}))


@pytest.mark.parametrize(
    "schema", [False, {"type": "integer", "minimum": 5, "maximum": 4}, {"maxLength": 1, "minLength": 2}]
)
def test_schemas_nothing_satisfies_are_refused(schema: Any) -> None:
    with pytest.raises(ValueError):
        SchemaGrammar(schema, "s", []).value(schema)


@settings(max_examples=40, deadline=None)
@given(
    low=st.none() | st.integers(-1200, 1200),
    span=st.none() | st.integers(0, 2500),
    probes=st.lists(st.integers(-3000, 3000), min_size=5, max_size=12),
)
@example(low=105, span=290, probes=[250, 150, 199, 300, 350])  # leading digits 1..3: the middle digit class
def test_integer_range_accepts_exactly_the_integers_in_range(
    low: int | None, span: int | None, probes: list[int], artifacts: ReferenceArtifacts
) -> None:
    high = None if span is None else (span if low is None else low + span)
    gbnf = f"root ::= {integer_range(low, high)}"
    accepts = Acceptor(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf)), artifacts)
    edges = [b + d for b in (low, high) if b is not None for d in (-1, 0, 1)]
    for n in [*probes, *edges, 0]:
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert accepts(str(n)) == inside, n
    assert not accepts("-0") and not accepts("007")


# ---- property-based: random schemas, values near their edges ---------------------------------------------

KEYS = ("a", "b", "c")
SMALL_INTS = st.integers(-25, 25)


@st.composite
def integer_schemas(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": draw(st.sampled_from(["integer", "number"]))}
    low = draw(st.none() | SMALL_INTS)
    if low is not None:
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low if low is not None else 0) + draw(st.integers(1, 40))
    return schema


@st.composite
def string_schemas(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    low = draw(st.integers(0, 2))
    if low:
        schema["minLength"] = low
    if draw(st.booleans()):
        schema["maxLength"] = low + draw(st.integers(0, 3))
    return schema


LEAF_VALUES = st.none() | st.booleans() | SMALL_INTS | st.text("ab", max_size=3)
LEAF_SCHEMAS = st.one_of(
    integer_schemas(),
    string_schemas(),
    st.lists(LEAF_VALUES, min_size=1, max_size=3, unique_by=json.dumps).map(lambda values: {"enum": values}),
    LEAF_VALUES.map(lambda value: {"const": value}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["integer", "null"]}, {}]),
)


def container_schemas(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.builds(
        lambda props, required, extra: {
            "type": "object",
            "properties": props,
            "required": [k for k in props if k in required],
            **({"additionalProperties": extra} if extra is not None else {}),
        },
        st.dictionaries(st.sampled_from(KEYS), inner, min_size=1, max_size=3),
        st.sets(st.sampled_from(KEYS)),
        st.none() | st.just(False) | inner,
    )
    arrays = st.builds(
        lambda items, low, span: {
            "type": "array",
            "items": items,
            **({"minItems": low} if low else {}),
            **({"maxItems": low + span} if span is not None else {}),
        },
        inner,
        st.integers(0, 2),
        st.none() | st.integers(0, 2),
    )
    unions = st.lists(inner, min_size=2, max_size=3).map(lambda branches: {"anyOf": branches})
    return objects | arrays | unions


SCHEMAS = st.recursive(LEAF_SCHEMAS, container_schemas, max_leaves=5)


def near(schema: dict[str, Any], draw: st.DrawFn, depth: int = 0) -> Any:
    """A value that fits ``schema`` or misses it narrowly (a bound off by one, a key missing or extra)."""
    if "const" in schema:
        return schema["const"] if draw(st.booleans()) else draw(LEAF_VALUES)
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]) | LEAF_VALUES)
    if "anyOf" in schema:
        return near(draw(st.sampled_from(schema["anyOf"])), draw, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = draw(st.sampled_from(kind))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -30))
        value = draw(st.integers(low - 2, schema.get("maximum", low + 40) + 2))
        return value + 0.5 if kind == "number" and draw(st.booleans()) else value
    if kind == "string":
        high = schema.get("maxLength", 4)
        return draw(st.text("ab<", max_size=high + 1))
    if kind == "boolean":
        return draw(st.booleans())
    if kind == "null":
        return None
    if kind == "object":
        props = schema["properties"]
        out = {k: near(sub, draw, depth + 1) for k, sub in props.items() if draw(st.integers(0, 3))}
        if draw(st.integers(0, 4)) == 0:
            out[draw(st.sampled_from(["z", *KEYS]))] = draw(LEAF_VALUES)
        return {k: out[k] for k in [*props, *out] if k in out}  # declared order, as both compilers require
    if kind == "array":
        size = draw(st.integers(max(schema.get("minItems", 0) - 1, 0), schema.get("maxItems", 2) + 1))
        return [near(schema["items"], draw, depth + 1) for _ in range(size)]
    return draw(LEAF_VALUES)


@st.composite
def value_near(draw: st.DrawFn, schema: dict[str, Any]) -> Any:
    return near(schema, draw)


@settings(max_examples=40, deadline=None)
@given(schema=SCHEMAS, data=st.data())
def test_random_schemas_never_accept_what_the_engines_json_compiler_refuses(
    schema: dict[str, Any], data: st.DataObject, artifacts: ReferenceArtifacts
) -> None:
    try:
        mine = ours(schema, artifacts)
    except ValueError:  # nothing satisfies it (e.g. a required key whose schema is an empty range)
        return
    theirs = engines(schema, artifacts)
    for _ in range(6):
        text = json.dumps(data.draw(value_near(schema)))
        assert theirs(text) or not mine(text), f"accepts what the schema forbids: {text} for {schema}"


# ---- pattern and format (regex_grammar) ---------------------------------------------------------------------

PATTERNS = [
    "^[A-Z]{3}-[0-9]{2}$",
    "ab",  # unanchored: anywhere in the string
    "^a.c$",
    r"^\d+(\.\d{1,2})?$",
    "^(red|green)+$",
    r'^[^"\\]*$',
    "x$|^y",
    r"^\w+@\w+\.(com|org)$",
    r'^"q"\\$',
]
PROBES = st.text(alphabet='abcxyRG-.@\\"0123', max_size=7)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=30, deadline=None)
@given(probes=st.lists(PROBES, min_size=4, max_size=8))
def test_a_pattern_accepts_exactly_the_strings_it_matches_in_both_spellings(
    pattern: str, probes: list[str], artifacts: ReferenceArtifacts
) -> None:
    """JSON Schema's ``pattern`` is a search (anchors only where written); as a JSON string the characters are
    escaped, as raw DSML text they are as they are (raw text never holds ``<``)."""
    json_value = ours({"type": "string", "pattern": pattern}, artifacts)
    raw = pattern_expression(pattern, "raw")
    assert raw is not None
    raw_value = Acceptor(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(f"root ::= {raw}")), artifacts)
    fixed = {"AAA-12", "ab", "abc", "12.5", "redgreen", "x", "y", "ab@cd.org", '"q"\\'}
    for text in [*probes, *fixed]:
        matches = re.search(pattern, text) is not None
        assert json_value(json.dumps(text)) == matches, (pattern, text)
        assert raw_value(text) == matches, (pattern, text)


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        ("date", ["2026-12-01", "2000-02-29"], ["2026-13-01", "26-12-01", "2026-12-1"]),
        (
            "date-time",
            ["2026-12-01T10:20:30Z", "2026-12-01t10:20:30.5+01:00"],
            ["2026-12-01 10:20:30", "2026-12-01T25:00:00Z"],
        ),
        ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
        ("ipv4", ["10.0.0.255"], ["10.0.0.256", "1.2.3"]),
        ("email", ["a.b@example.com"], ["a@b", "@example.com"]),
    ],
)
def test_supported_formats_are_compiled(
    kind: str, good: list[str], bad: list[str], artifacts: ReferenceArtifacts
) -> None:
    accepts = ours({"type": "string", "format": kind}, artifacts)
    assert all(accepts(json.dumps(text)) for text in good), good
    assert not any(accepts(json.dumps(text)) for text in bad), bad


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "multipleOf": 5},
        {"type": "object", "properties": {"a": {}}, "minProperties": 1},
        {"type": "string", "pattern": "^a", "maxLength": 3},
        {"type": "string", "pattern": "(?=a)a"},
        {"type": "string", "pattern": r"(a)\1"},
        {"type": "integer", "maximum": 10**20},
    ],
    ids=["multipleOf", "minProperties", "pattern-and-length", "lookahead", "backreference", "bound"],
)
def test_what_a_forced_call_cannot_enforce_is_refused_not_ignored(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"not supported|bound"):
        SchemaGrammar(schema, "s", []).value(schema)

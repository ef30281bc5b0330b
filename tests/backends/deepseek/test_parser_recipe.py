"""The V4.1 output parser against DeepSeek's own: deepseek-recipe's ``StreamProcessor`` is the oracle.

The gateway parses V4.1 output in Python (docs/deepseek.md says why); these tests prove it identical to DeepSeek's
Rust parser on a corpus the suite keeps: fixed cases for each rule (reasoning, content, DSML tool calls, newlines,
cut output, the starting stages of a ``prefix`` continuation) and Hypothesis-generated outputs split anywhere.
Arguments are compared as JSON values: DeepSeek's parser streams them as text, the gateway sends each call's at once.
The differences the gateway keeps on purpose (schema typing, valid JSON for malformed or cut calls, stripped and
non-empty names) are outside this corpus and tested in test_parser.py.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import deepseek_recipe as recipe
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepseek.parser import DeepSeekV41OutputParser, Stage

RECIPE_STAGES: dict[Stage, recipe.ThinkingInitialStage | None] = {
    Stage.REASONING: recipe.ThinkingInitialStage.ReasoningStart,
    Stage.REASONING_CONTINUATION: recipe.ThinkingInitialStage.ReasoningContinuation,
    Stage.CONTENT: None,
    Stage.CONTENT_CONTINUATION: recipe.ThinkingInitialStage.ContentContinuation,
}
"""Our starting stage and the library's: ``None`` is the library's thinking mode off."""

REQUEST = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}], "stream": True}

# Literal DSML, deliberately not built from the product's constants.
CALLS_OPEN = "<｜DSML｜ calls>"
CALLS_CLOSE = "</｜DSML｜ calls>"
INVOKE_CLOSE = "</｜DSML｜ invoke>"


class Parsed(NamedTuple):
    """One completion as a client reassembles it: the calls as (id prefix, name, arguments as JSON values)."""

    reasoning: str
    content: str
    calls: list[tuple[str, str, Any]]
    finish: str


def by_recipe(chunks: Sequence[str], stage: Stage, *, tools: bool = True, stops: Sequence[str] = ()) -> Parsed:
    """What DeepSeek's ``StreamProcessor`` makes of the chunks, read from its Chat Completions chunks."""
    conversation = recipe.ChatCompletionRequest(REQUEST).convert(recipe.ConversionOptions())
    generator = recipe.ChatCompletionRequest.chunk_generator(conversation, "chatcmpl-test", "m")
    options = recipe.ParsingOptions(
        parse_tool_calls=tools, thinking_initial_stage=RECIPE_STAGES[stage], stop_sequences=stops
    )
    processor = recipe.StreamProcessor(generator, options)
    out = processor.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=1)))
    for chunk in chunks:
        if processor.finished:  # a stop sequence ended it
            break
        out += processor.push(recipe.InferenceChunk.text(chunk, 1))
    if not processor.finished:
        out += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    out += processor.finish()
    reasoning, content, finish = [], [], ""
    calls: list[list[Any]] = []
    for item in out:
        for choice in orjson.loads(item.to_json())["choices"]:
            delta = choice["delta"]
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    assert call["index"] == len(calls)
                    calls.append([call["id"], call["function"]["name"], ""])
                calls[call["index"]][2] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return Parsed(
        "".join(reasoning),
        "".join(content),
        [(_id_prefix(i), name, json.loads(arguments)) for i, name, arguments in calls],
        finish,
    )


def by_gateway(chunks: Sequence[str], stage: Stage, *, tools: bool = True, stops: Sequence[str] = ()) -> Parsed:
    """What the gateway's parser makes of the same chunks (tools declared without schemas: no typing)."""
    parser = DeepSeekV41OutputParser(stage=stage, tools={} if tools else None, stops=stops)
    pieces = []
    for chunk in chunks:
        if parser.matched_stop is not None:  # the choice ends there: the engine request is aborted
            break
        pieces.append(parser.push(chunk))
    pieces.append(parser.finish())
    calls: list[list[Any]] = []
    for piece in pieces:
        for call in piece.tool_calls:
            if call.id is not None:
                assert call.index == len(calls)
                assert re.fullmatch(r"call_\d\d_[A-Za-z0-9]{24}", call.id), call.id
                calls.append([call.id, call.name, call.arguments])
            else:
                calls[call.index][2] += call.arguments
    return Parsed(
        "".join(p.reasoning for p in pieces),
        "".join(p.content for p in pieces),
        [(_id_prefix(i), name, json.loads(arguments)) for i, name, arguments in calls],
        "tool_calls" if parser.called and parser.matched_stop is None else "stop",
    )


def _id_prefix(call_id: str) -> str:
    """``call_`` and the call's index, which DeepSeek's ids start with; the rest is random."""
    assert re.match(r"call_\d\d_", call_id), call_id
    return call_id[:8]


def invoke(name: str, **params: Any) -> str:
    """One DSML invoke as V4.1 writes it: text values raw with ``string="true"``, others as JSON."""
    lines = [
        f'<｜DSML｜ parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</｜DSML｜ parameter>"
        for key, value in params.items()
    ]
    return f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(lines) + "\n</｜DSML｜ invoke>"


def calls_block(*invokes: str) -> str:
    return CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE


WEATHER = invoke("get_weather", city="Paris", days=2)
SEARCH = invoke("search", q="V4.1", filters={"lang": ["en", "fr"], "recent": True}, limit=None)

CORPUS: list[tuple[str, list[str], Stage]] = [
    ("reasoning then answer", ["Let me see.", "</think>", "The answer is 4."], Stage.REASONING),
    ("new reasoning drops its leading newlines", ["\n\nhmm</think>ok"], Stage.REASONING),
    ("reasoning continuation keeps them", ["\n\nhmm</think>ok"], Stage.REASONING_CONTINUATION),
    ("answer after reasoning drops its leading newlines", ["r</think>\n", "\nHello \n"], Stage.REASONING),
    ("chat answer drops its leading newlines, keeps trailing ones", ["\n\nHello\n\n"], Stage.CONTENT),
    ("answer continuation keeps them", ["\n\nHello"], Stage.CONTENT_CONTINUATION),
    ("only spaces and tabs lead: kept", [" \t\nHello"], Stage.CONTENT),
    ("newlines before </think> are dropped", ["r\n\n", "</think>x"], Stage.REASONING),
    ("a space before them is kept", ["r\n \n</think>x"], Stage.REASONING),
    ("carriage returns are not newlines", ["r\r\n</think>\r\nx"], Stage.REASONING),
    ("<think> is text in the answer", ["a<think>b</think>c"], Stage.CONTENT),
    ("<think> is text in the reasoning", ["a<think>b</think>c"], Stage.REASONING),
    ("</think> in the answer is dropped, newlines kept", ["a\n</think>\nb"], Stage.CONTENT),
    ("</think> in a continued answer is dropped", ["x</think>\n\ny"], Stage.CONTENT_CONTINUATION),
    ("newlines before a dropped </think> stay", ["a\n</think>" + calls_block(WEATHER)], Stage.CONTENT),
    ("chat tool call: no content", ["\n\n" + calls_block(WEATHER)], Stage.CONTENT),
    ("newlines before calls are dropped", ["Checking.\n\n" + calls_block(WEATHER, SEARCH)], Stage.CONTENT),
    ("spaces before calls kept", ["hi \n " + calls_block(WEATHER)], Stage.CONTENT),
    ("calls end the reasoning", ["thinking\n\n", calls_block(SEARCH)], Stage.REASONING),
    ("calls after reasoning", ["r</think>\n\n" + calls_block(WEATHER)], Stage.REASONING),
    ("a bare invoke is a call", ["a\n\n" + WEATHER], Stage.CONTENT),
    ("a bare invoke ends the reasoning", ["r\n" + SEARCH], Stage.REASONING),
    ("text after the calls is dropped", [calls_block(WEATHER) + "\n\nmore " + CALLS_OPEN], Stage.CONTENT),
    ("a second calls block is dropped", [calls_block(WEATHER) + calls_block(SEARCH)], Stage.CONTENT),
    ("junk between invokes is dropped", [CALLS_OPEN + "junk\n" + WEATHER + "junk2\n" + CALLS_CLOSE], Stage.CONTENT),
    ("</calls> inside a call ends it", [CALLS_OPEN + WEATHER.removesuffix(INVOKE_CLOSE) + CALLS_CLOSE], Stage.CONTENT),
    ("</think> in a value is data", [invoke("f", a="x</think>y")], Stage.REASONING),
    ("continued answer then calls", ["x\n\n" + calls_block(WEATHER)], Stage.CONTENT_CONTINUATION),
    ("cut before the DSML marker: text", ["abc\n<｜DSML"], Stage.CONTENT),
    ("cut after the DSML marker: markup", ["abc\n\n<｜DSML｜ ca"], Stage.CONTENT),
    ("cut invoke in reasoning: markup", ["abc\n<｜DSML｜ inv"], Stage.REASONING),
    ("cut </think>: text", ["abc<thi", "</thi"], Stage.REASONING),
    ("a lone < is text", ["Hello\n\n<"], Stage.CONTENT),
    ("a call whose name never ended", [CALLS_OPEN + '\n<｜DSML｜ invoke name="get'], Stage.CONTENT),
    ("reasoning only, trailing newlines kept", ["abc\n\n"], Stage.REASONING),
    ("newlines only, then </think>", ["\n", "</think>"], Stage.REASONING),
    ("nothing", [], Stage.CONTENT),
    # A call marker that opens no calls block and no call: the rest is markup up to the next call (found by the
    # generated test below, pinned here).
    ("a marker that opens nothing, in reasoning", ["<｜DSML｜<"], Stage.REASONING),
    ("a marker that opens nothing, then text", ["a<｜DSML｜<", "x"], Stage.CONTENT),
    ("a marker that opens nothing, then </think>", ["<｜DSML｜x</think>hello"], Stage.CONTENT_CONTINUATION),
    (
        "a marker that opens nothing, then a call",
        ["hi <｜DSML｜x " + CALLS_OPEN + '\n<｜DSML｜ invoke name="get">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'],
        Stage.CONTENT,
    ),
    (
        "an opening cut across chunks",
        ["<｜DSML｜ cal", "ls>", '\n<｜DSML｜ invoke name="get">\n</｜DSML｜ invoke>'],
        Stage.CONTENT,
    ),
]


@pytest.mark.parametrize(("chunks", "stage"), [(c, s) for _, c, s in CORPUS], ids=[name for name, _, _ in CORPUS])
def test_corpus_parses_as_deepseek_recipe_parses_it(chunks: list[str], stage: Stage) -> None:
    expected = by_recipe(chunks, stage)
    assert by_gateway(chunks, stage) == expected
    assert by_gateway(list("".join(chunks)), stage) == expected  # split between every character


STOP_CORPUS: list[tuple[str, list[str], Stage, list[str]]] = [
    ("a stop ends the answer", ["Hello STOP more"], Stage.CONTENT, ["STOP"]),
    ("split across pieces", ["Hello ST", "OP more"], Stage.CONTENT, ["STOP"]),
    ("a stop's start at the end is text", ["Hello ST"], Stage.CONTENT, ["STOP"]),
    ("not in the reasoning", ["rSTOPx</think>Hello STOP"], Stage.REASONING, ["STOP"]),
    ("not across </think>", ["rST</think>OPx"], Stage.REASONING, ["STOP"]),
    ("not in a call's arguments", [calls_block(invoke("f", q="a STOP b"))], Stage.CONTENT, ["STOP"]),
    ("held newlines before it are answer", ["Hello\n\n", "STOP"], Stage.CONTENT, ["STOP"]),
    ("it may start with newlines", ["Hello\n\nSTOP"], Stage.CONTENT, ["\n\nSTOP"]),
    ("an answer's leading newlines, before they are dropped", ["\n\nab"], Stage.CONTENT, ["\n"]),
    ("not across them once dropped", ["\n\nab"], Stage.CONTENT, ["\nab"]),
    ("a continuation keeps them", ["\n\nab"], Stage.CONTENT_CONTINUATION, ["\nab"]),
    ("a tag's start before it is known", ["Hello\n\n" + calls_block(WEATHER)], Stage.CONTENT, ["\n\n<"]),
    ("not a tag once known", ["x" + calls_block(WEATHER)], Stage.CONTENT, ["｜DSML｜ calls"]),
    ("not across a dropped </think>", ["ab\n\n</think>cd"], Stage.CONTENT, ["\n\nc"]),
    ("the start of </think>", ["ab</thi", "nk>cd"], Stage.CONTENT, ["b</thi"]),
    ("<think> is answer text", ["a<think>b"], Stage.CONTENT, ["<think>"]),
    ("the first one complete wins", ["abcd"], Stage.CONTENT, ["bc", "abcd"]),
    ("then the one listed first", ["xabcd"], Stage.CONTENT, ["bcd", "abcd"]),
    ("the one listed first", ["xabcd"], Stage.CONTENT, ["abcd", "bcd"]),
    ("newline stop", ["a\nb"], Stage.CONTENT, ["\n"]),
]


@pytest.mark.parametrize(
    ("chunks", "stage", "stops"), [(c, s, t) for _, c, s, t in STOP_CORPUS], ids=[n for n, *_ in STOP_CORPUS]
)
def test_stop_sequences_end_the_answer_as_in_deepseek_recipe(chunks: list[str], stage: Stage, stops: list[str]) -> None:
    expected = by_recipe(chunks, stage, stops=stops)
    assert by_gateway(chunks, stage, stops=stops) == expected
    assert by_gateway(list("".join(chunks)), stage, stops=stops) == expected


def test_without_tool_parsing_dsml_is_text_as_in_deepseek_recipe() -> None:
    chunks = ["Hi\n\n" + calls_block(WEATHER), "\n<｜DSML｜ ca"]
    for stage in Stage:
        assert by_gateway(chunks, stage, tools=False) == by_recipe(chunks, stage, tools=False)


def test_tool_call_ids_are_deepseeks_index_and_random_part() -> None:
    parser = DeepSeekV41OutputParser(stage=Stage.CONTENT, tools={})
    calls = [*parser.push(calls_block(WEATHER, SEARCH)).tool_calls, *parser.finish().tool_calls]
    ids = [call.id for call in calls if call.id is not None]
    assert [i[:8] for i in ids] == ["call_00_", "call_01_"]
    assert all(re.fullmatch(r"call_\d\d_[A-Za-z0-9]{24}", i) for i in ids)
    assert len({i[8:] for i in ids}) == 2


# ---- generated outputs ------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["get_weather", "search", "f"])
KEYS = st.sampled_from(["city", "days", "q", "filters", "limit", "a"])
VALUE_TEXT = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | VALUE_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
INVOKES = st.builds(lambda name, params: invoke(name, **params), NAMES, st.dictionaries(KEYS, JSON_VALUES, max_size=3))


@st.composite
def tool_calls(draw: st.DrawFn) -> str:
    invokes = draw(st.lists(INVOKES, min_size=1, max_size=3))
    return calls_block(*invokes) if draw(st.booleans()) else invokes[0]


TEXT = st.text(alphabet="ab <>/\n｜\t", max_size=10) | st.text(max_size=6)
FRAGMENTS = TEXT | st.sampled_from(["<think>", "</think>", "\n", "\n\n", "  \n", "</", "<｜DSML"]) | tool_calls()
CUTS = st.sampled_from(["", "<", "<｜", "<｜DSML", "<｜DSML｜", "<｜DSML｜ cal", '<｜DSML｜ invoke name="', "</thi"])


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=10)))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    fragments=st.lists(FRAGMENTS, max_size=8),
    cut=CUTS,
    stage=st.sampled_from(list(Stage)),
    tools=st.booleans(),
)
def test_generated_outputs_parse_as_deepseek_recipe_parses_them(
    data: st.DataObject, fragments: list[str], cut: str, stage: Stage, tools: bool
) -> None:
    text = "".join(fragments) + cut
    chunks = data.draw(split(text))
    assert by_gateway(chunks, stage, tools=tools) == by_recipe(chunks, stage, tools=tools)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    fragments=st.lists(FRAGMENTS, max_size=6),
    stage=st.sampled_from(list(Stage)),
    tools=st.booleans(),
    others=st.lists(st.text(alphabet="ab \n<", min_size=1, max_size=3), max_size=2),
)
def test_generated_outputs_stop_as_in_deepseek_recipe(
    data: st.DataObject, fragments: list[str], stage: Stage, tools: bool, others: list[str]
) -> None:
    text = "".join(fragments)
    stops = list(others)
    if text:  # a piece of the output itself, so that stops do match
        start = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + data.draw(st.integers(1, 6))])
    chunks = data.draw(split(text))
    assert by_gateway(chunks, stage, tools=tools, stops=stops) == by_recipe(chunks, stage, tools=tools, stops=stops)

"""The V4.1 output parser: reasoning, content and DSML tool calls, the same for any split of the text (H8)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepseek.arguments import arguments_json
from backends.deepseek.parser import DeepSeekV41OutputParser, ParsedText, tool_schemas

from .dsml_text import ToolCall, render_tool_calls

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
F_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "n": {"type": "array"}, "o": {"type": "object"}},
}
WEATHER: dict[str, Any] = {"get_weather": WEATHER_PARAMETERS, "f": F_PARAMETERS}

# Literal DSML, deliberately not built from the module's constants.
CALLS_OPEN = "<｜DSML｜ calls>"
CALLS_CLOSE = "</｜DSML｜ calls>"


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜ invoke>"


def param(name: str, value: str, string: bool = True) -> str:
    return f'<｜DSML｜ parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜ parameter>'


def counter_ids() -> Callable[[int], str]:
    numbers = itertools.count()
    return lambda index: f"call_{next(numbers)}"


class Result:
    """Everything a parser emitted for one completion, reassembled as a client would."""

    def __init__(self, pieces: Sequence[ParsedText], called: bool) -> None:
        self.reasoning = "".join(p.reasoning for p in pieces)
        self.content = "".join(p.content for p in pieces)
        self.calls: list[dict[str, Any]] = []
        for piece in pieces:
            for delta in piece.tool_calls:
                if delta.index == len(self.calls):
                    assert delta.id and delta.name is not None, "a call's first piece carries its id and name"
                    self.calls.append({"id": delta.id, "name": delta.name, "arguments": delta.arguments})
                else:
                    assert delta.index == len(self.calls) - 1 and delta.id is None and delta.name is None
                    self.calls[-1]["arguments"] += delta.arguments
        self.called = called

    def as_tuple(self) -> tuple[str, str, list[dict[str, Any]], bool]:
        return self.reasoning, self.content, self.calls, self.called


def parse(
    chunks: Sequence[str],
    *,
    in_reasoning: bool = False,
    tools: dict[str, Any] | None = WEATHER,
    max_calls: int | None = None,
    literal_content: bool = False,
) -> Result:
    parser = DeepSeekV41OutputParser(
        in_reasoning=in_reasoning,
        tools=tools,
        max_calls=max_calls,
        literal_content=literal_content,
        new_id=counter_ids(),
    )
    pieces = [parser.push(chunk) for chunk in chunks]
    pieces.append(parser.finish())
    return Result(pieces, parser.called)


def test_thinking_prompt_gives_reasoning_then_content() -> None:
    result = parse(["Let me see.</think>The answer is 4."], in_reasoning=True)
    assert (result.reasoning, result.content, result.calls) == ("Let me see.", "The answer is 4.", [])


def test_chat_prompt_gives_content_only_and_a_think_tag_is_text() -> None:
    """As in DeepSeek's parser, only the prompt opens a reasoning: a ``<think>`` the model writes is text."""
    assert parse(["plain answer"]).as_tuple() == ("", "plain answer", [], False)
    result = parse(["<think>hmm</think>done"])
    assert (result.reasoning, result.content) == ("", "<think>hmmdone")


def test_bare_close_tag_in_content_is_dropped_and_open_tag_in_reasoning_is_text() -> None:
    assert parse(["a</think>b"]).content == "ab"
    result = parse(["x<think>y</think>z"], in_reasoning=True)
    assert (result.reasoning, result.content) == ("x<think>y", "z")


def test_chat_mode_tool_call_gives_json_arguments_and_no_content() -> None:
    text = "\n\n" + CALLS_OPEN + "\n" + invoke("get_weather", param("city", "Paris"), param("days", "2", False))
    result = parse([text + "\n" + CALLS_CLOSE])
    assert result.content == ""
    assert result.calls == [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]
    assert result.called


def test_text_before_calls_is_content_and_parallel_calls_keep_their_order() -> None:
    text = (
        "Checking both.\n\n"
        + CALLS_OPEN
        + "\n"
        + invoke("get_weather", param("city", "Paris"))
        + "\n"
        + invoke("get_weather", param("city", "Oslo"))
        + "\n"
        + CALLS_CLOSE
    )
    result = parse([text])
    assert result.content == "Checking both."  # the newlines before the calls are dropped, as DeepSeek's parser does
    assert [json.loads(c["arguments"]) for c in result.calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert [c["id"] for c in result.calls] == ["call_0", "call_1"]


def test_tool_block_inside_reasoning_ends_reasoning() -> None:
    text = "thinking " + CALLS_OPEN + "\n" + invoke("f", param("q", "x")) + "\n" + CALLS_CLOSE
    result = parse([text], in_reasoning=True)
    assert result.reasoning == "thinking "
    assert result.calls == [{"id": "call_0", "name": "f", "arguments": '{"q": "x"}'}]


def test_string_false_values_are_json_or_fall_back_to_raw_text() -> None:
    raw = param("n", "[1, 2]", False) + param("o", '{"k": true}', False) + param("q", "not json", False)
    assert json.loads(arguments_json(raw, None)) == {"n": [1, 2], "o": {"k": True}, "q": "not json"}


def test_string_true_values_are_raw_even_when_they_look_like_json() -> None:
    assert json.loads(arguments_json(param("q", "42") + param("n", "  spaced\nline "), None)) == {
        "q": "42",
        "n": "  spaced\nline ",
    }


def test_missing_parameter_close_tag_ends_at_next_parameter() -> None:
    raw = '<｜DSML｜ parameter name="city" string="true">Paris\n' + param("days", "3", False)
    assert json.loads(arguments_json(raw, None)) == {"city": "Paris\n", "days": 3}


def test_unwrap_rule_replaces_undeclared_arguments_wrapper_with_its_object() -> None:
    wrapped = param("arguments", '{"city": "Rome", "days": 1}', False)
    assert json.loads(arguments_json(wrapped, WEATHER["get_weather"])) == {"city": "Rome", "days": 1}
    as_string = param("input", '{"city": "Rome"}')
    assert json.loads(arguments_json(as_string, WEATHER["get_weather"])) == {"city": "Rome"}


def test_unwrap_rule_keeps_wrapper_when_declared_or_keys_unknown_or_tool_unknown() -> None:
    declared = {"type": "object", "properties": {"arguments": {"type": "object"}, "city": {"type": "string"}}}
    wrapped = param("arguments", '{"city": "Rome"}', False)
    assert json.loads(arguments_json(wrapped, declared)) == {"arguments": {"city": "Rome"}}
    unknown_keys = param("arguments", '{"town": "Rome"}', False)
    assert json.loads(arguments_json(unknown_keys, WEATHER["get_weather"])) == {"arguments": {"town": "Rome"}}
    assert json.loads(arguments_json(wrapped, None)) == {"arguments": {"city": "Rome"}}


def test_max_calls_emits_only_the_first_call_but_consumes_the_others() -> None:
    text = CALLS_OPEN + invoke("f", param("q", "1")) + invoke("f", param("q", "2")) + CALLS_CLOSE
    result = parse([text], max_calls=1)
    assert [json.loads(c["arguments"]) for c in result.calls] == [{"q": "1"}]
    assert result.content == ""


def test_bare_invoke_without_the_calls_wrapper_is_a_call() -> None:
    """DeepSeek's parser (vLLM 0.33.0's V4.1 parser) reads an invoke written without ``<｜DSML｜ calls>`` as a call:
    the agent gets the call, and the user sees no markup."""
    text = "Let me look.\n\n" + invoke("get_weather", param("city", "Paris"), param("days", "2", False))
    result = parse([text])
    assert result.content == "Let me look."
    assert result.calls == [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]
    assert result.called
    two = parse(["\n\n" + invoke("f", param("q", "1")) + "\n" + invoke("f", param("q", "2"))])
    assert [json.loads(c["arguments"]) for c in two.calls] == [{"q": "1"}, {"q": "2"}] and two.content == ""
    # Inside the reasoning a bare invoke is a call too, and ends the reasoning, as in DeepSeek's parser.
    thinking = parse(["plan: " + invoke("f", param("q", "1"))], in_reasoning=True)
    assert thinking.reasoning == "plan: " and [json.loads(c["arguments"]) for c in thinking.calls] == [{"q": "1"}]


def test_text_after_the_call_block_is_dropped() -> None:
    """The calls end the turn (V4.1 writes EOS there); DeepSeek's parser rejects text after them and vLLM's drops
    it, so a continuation the model should not have written (say, an invented tool result) never reaches the
    client as an answer. A call after the block is dropped too, as DeepSeek's parser drops it."""
    block = CALLS_OPEN + "\n" + invoke("f", param("q", "1")) + "\n" + CALLS_CLOSE
    result = parse(["Sure.\n\n" + block + "\n\nThe result is 42. <think>x</think>"])
    assert result.content == "Sure." and [json.loads(c["arguments"]) for c in result.calls] == [{"q": "1"}]
    again = parse([block + " and " + invoke("f", param("q", "2")) + CALLS_CLOSE + " tail"])
    assert [json.loads(c["arguments"]) for c in again.calls] == [{"q": "1"}] and again.content == ""


def test_parameter_without_a_string_attribute_is_read_as_json_or_text() -> None:
    """vLLM's V4.1 parser reads a parameter whose ``string`` attribute is missing as ``string="false"``: dropping
    it would hand the client a call without that argument."""
    raw = '<｜DSML｜ parameter name="days">3</｜DSML｜ parameter>\n'
    raw += '<｜DSML｜ parameter name="city" >Oslo</｜DSML｜ parameter>'
    assert json.loads(arguments_json(raw, None)) == {"days": 3, "city": "Oslo"}
    assert json.loads(arguments_json(raw, WEATHER_PARAMETERS)) == {"days": 3, "city": "Oslo"}


def test_newlines_around_the_end_of_the_reasoning_are_dropped_other_whitespace_kept() -> None:
    """As DeepSeek's parser does: newlines right before ``</think>`` and at the start of the answer go."""
    result = parse(["Let me think.\n\n</think>\nAnswer"], in_reasoning=True)
    assert (result.reasoning, result.content) == ("Let me think.", "Answer")
    result = parse(["Let me think. \n</think> Answer"], in_reasoning=True)
    assert (result.reasoning, result.content) == ("Let me think. ", " Answer")


def test_without_tools_dsml_stays_content() -> None:
    text = CALLS_OPEN + invoke("f", param("q", "1")) + CALLS_CLOSE
    result = parse(["\n\n" + text], tools=None)
    assert result.content == text and result.calls == [] and not result.called


def test_literal_content_keeps_tags_after_the_reasoning_as_data() -> None:
    result = parse(
        ['thinking</think>{"note": "<think>x</think>"}'], in_reasoning=True, tools=None, literal_content=True
    )
    assert (result.reasoning, result.content) == ("thinking", '{"note": "<think>x</think>"}')
    assert parse(["<think>a"], tools=None, literal_content=True).content == "<think>a"


def test_an_answer_drops_its_leading_newlines_and_keeps_other_whitespace() -> None:
    assert parse(["\n\n  "]).content == "  "
    assert parse(["\n", "\n"]).content == ""


def test_unterminated_call_at_the_end_keeps_only_its_complete_parameters() -> None:
    text = CALLS_OPEN + invoke("get_weather", param("city", "Paris"))[: -len("\n</｜DSML｜ invoke>")]
    for cut in ('\n<｜DSML｜ parameter name="days" string="false">1', '\n<｜DSML｜ parameter name="da', "\n<"):
        result = parse([text + cut])
        assert result.calls == [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_value_cut_inside_its_closing_tag_is_dropped_not_handed_over_with_markup() -> None:
    head = CALLS_OPEN + '\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">London'
    for cut in ("</｜DSML｜ parameter", "</｜DSML｜", "<", ""):
        assert parse([head + cut]).calls == [{"id": "call_0", "name": "get_weather", "arguments": "{}"}]


def test_call_names_are_stripped_and_nameless_calls_dropped() -> None:
    text = CALLS_OPEN + invoke(" get_weather\n", param("city", "Oslo")) + invoke("  ", param("q", "x"))
    text += invoke("f", param("q", "y")) + CALLS_CLOSE
    result = parse([text])
    assert [(c["id"], c["name"], c["arguments"]) for c in result.calls] == [
        ("call_0", "get_weather", '{"city": "Oslo"}'),
        ("call_1", "f", '{"q": "y"}'),
    ]
    assert parse([CALLS_OPEN + invoke("", param("q", "x")) + CALLS_CLOSE]).as_tuple() == ("", "", [], False)


def test_call_whose_name_never_finished_is_not_emitted() -> None:
    result = parse([CALLS_OPEN + '<｜DSML｜ invoke name="get_we'])
    assert result.calls == [] and not result.called


def test_partial_tag_at_the_end_is_released_as_text() -> None:
    assert parse(["answer <thi"]).content == "answer <thi"
    assert parse(["reason </thin"], in_reasoning=True).reasoning == "reason </thin"


def test_call_block_cut_inside_its_opening_tag_leaves_no_markup() -> None:
    """As in DeepSeek's parser: once ``<｜DSML｜`` is written, a cut opening is markup (with the newlines before
    it); before that it is text."""
    for cut in ("<｜DSML｜", "<｜DSML｜ cal", "<｜DSML｜ invoke name"):
        assert parse(["answer\n\n" + cut]).as_tuple() == ("", "answer", [], False)
        assert parse(["thinking\n" + cut], in_reasoning=True).reasoning == "thinking"
    for cut in ("<｜", "<｜DSML"):
        assert parse(["answer\n\n" + cut]).content == "answer\n\n" + cut
    assert parse(["answer <"]).content == "answer <"
    assert parse(["answer <｜DSML"], tools=None).content == "answer <｜DSML"  # without tools it is text


def test_text_without_a_tag_start_passes_straight_through() -> None:
    parser = DeepSeekV41OutputParser(in_reasoning=False, tools=None)
    assert parser.push("no tags here") == ParsedText("", "no tags here", ())
    parser = DeepSeekV41OutputParser(in_reasoning=True, tools=WEATHER)
    assert parser.push("a < b") == ParsedText("a < b", "", ())


def test_held_tag_prefix_is_released_once_it_cannot_be_a_tag() -> None:
    parser = DeepSeekV41OutputParser(in_reasoning=True, tools=None)
    assert parser.push("x </th") == ParsedText("x ", "", ())
    assert parser.push("ings") == ParsedText("</things", "", ())


def test_trailing_newlines_wait_for_what_follows_them() -> None:
    parser = DeepSeekV41OutputParser(in_reasoning=False, tools=WEATHER)
    assert parser.push("a\n\n") == ParsedText("", "a", ())
    assert parser.push("b") == ParsedText("", "\n\nb", ())


def test_token_sized_pieces_with_newline_runs_give_the_whole_texts_result() -> None:
    # One token per push, as the engine hands text over: newlines alone, ending a piece or opening one.
    pieces = [
        "\n",
        "\n",
        "Plan",
        ":\n",
        "\n",
        "1",
        ".",
        " a",
        "\n",
        "b\n",
        "c",
        "\n\n",
        "</think>",
        "\n\n",
        "Yes",
        ".\n",
        "\n",
    ]
    for in_reasoning, tools in itertools.product((True, False), (WEATHER, None)):
        whole = parse(["".join(pieces)], in_reasoning=in_reasoning, tools=tools).as_tuple()
        assert parse(pieces, in_reasoning=in_reasoning, tools=tools).as_tuple() == whole
    assert parse(pieces, in_reasoning=True).as_tuple() == ("Plan:\n\n1. a\nb\nc", "Yes.\n\n", [], False)


def test_tool_schemas_reads_each_tools_parameters() -> None:
    a = {"type": "object", "properties": {"x": {}}}
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": a}},
        {"type": "function", "function": {"name": "b"}},
    ]
    assert tool_schemas(tools) == {"a": a, "b": {}}


# ---- property-based: any chunking gives the result of one chunk ----------------------------------------------

JSON_LEAVES = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
SAFE_TEXT = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=10)
ARGUMENTS = st.dictionaries(st.sampled_from(["city", "days", "q", "n", "o", "extra"]), JSON_VALUES | SAFE_TEXT)


@st.composite
def tool_blocks(draw: st.DrawFn) -> str:
    calls = draw(
        st.lists(
            st.builds(ToolCall, st.just(""), st.sampled_from(["get_weather", "f", "unknown_tool"]), ARGUMENTS),
            min_size=1,
            max_size=3,
        )
    )
    return render_tool_calls(calls)


FRAGMENTS = st.one_of(
    st.text(alphabet="ab <>/\n｜", max_size=12),
    st.text(max_size=6),
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<thi",
            "</",
            "<｜DSML｜",
            CALLS_OPEN,
            CALLS_CLOSE,
            '<｜DSML｜ invoke name="f">',
            "</｜DSML｜ invoke>",
            "\n\n",
            "   ",
        ]
    ),
    tool_blocks(),
)


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    fragments=st.lists(FRAGMENTS, max_size=8),
    in_reasoning=st.booleans(),
    with_tools=st.booleans(),
    max_calls=st.sampled_from([None, 1]),
    literal=st.booleans(),
)
def test_any_chunking_gives_the_same_result_as_one_chunk(
    data: st.DataObject,
    fragments: list[str],
    in_reasoning: bool,
    with_tools: bool,
    max_calls: int | None,
    literal: bool,
) -> None:
    text = "".join(fragments)
    options: dict[str, Any] = {
        "in_reasoning": in_reasoning,
        "tools": WEATHER if with_tools else None,
        "max_calls": max_calls,
        "literal_content": literal,
    }
    whole = parse([text], **options)
    chunks = data.draw(split(text))
    assert parse(chunks, **options).as_tuple() == whole.as_tuple()
    per_char = parse(list(text), **options)
    assert per_char.as_tuple() == whole.as_tuple()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), arguments=st.lists(ARGUMENTS, min_size=1, max_size=3), lead=st.sampled_from(["", "\n\n"]))
def test_rendered_tool_calls_parse_back_to_their_arguments(
    data: st.DataObject, arguments: list[dict[str, Any]], lead: str
) -> None:
    calls = [ToolCall("", "unknown_tool", args) for args in arguments]
    text = lead + render_tool_calls(calls)[2:]
    result = parse(data.draw(split(text)))
    assert [json.loads(c["arguments"]) for c in result.calls] == arguments
    assert result.content == "" and result.called

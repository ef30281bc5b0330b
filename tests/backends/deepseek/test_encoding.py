"""Golden and behaviour tests for the DeepSeek V4.1 prompt encoder (format spec H1-H7)."""

from __future__ import annotations

import copy
import json

import pytest

from backends.deepseek.dsml import decode_tool_arguments, render_tools_block
from backends.deepseek.effort import effort_value
from backends.deepseek.encoding import encode_messages, prompt_ends_in_thinking
from backends.deepseek.markers import ASSISTANT, BOS, EOS, IMAGE_PLACEHOLDER, THINK_END, THINK_START, USER

# Literal strings, deliberately not built from the module's constants.
B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
EFFORT_75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

TOOLS_HEADER = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:\n\n'
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
    '\n\nString parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
    "\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response."
    "\n\nOtherwise, output directly after </think> with tool calls or final response."
    "\n\n### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_SCHEMA_LINE = (
    '{"name": "get_weather", "description": "Weather forecast for a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}'
)
F_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
F_SCHEMA_LINE = '{"name": "f", "parameters": {"type": "object"}}'


def call(call_id: str, name: str, arguments: object) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def dsml_param(key: str, value: str, *, string: bool) -> str:
    flag = "true" if string else "false"
    return f'<｜DSML｜ parameter name="{key}" string="{flag}">{value}</｜DSML｜ parameter>'


def dsml_calls(*invokes: tuple[str, list[str]]) -> str:
    bodies = [
        f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜ invoke>" for name, params in invokes
    ]
    return "\n\n<｜DSML｜ calls>\n" + "\n".join(bodies) + "\n</｜DSML｜ calls>"


# --- H7 golden prompts ----------------------------------------------------------------------------------


def test_h7_1_chat_mode_single_user_turn() -> None:
    prompt = encode_messages([{"role": "user", "content": "Hi"}], thinking=False)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


def test_h7_2_thinking_mode_default_effort_prefixes_system_message() -> None:
    prompt = encode_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], thinking=True)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\nS<｜User｜>Hi<｜Assistant｜><think>"
    )


HISTORY_ABC = [
    {"role": "user", "content": "A"},
    {"role": "assistant", "content": "B", "reasoning_content": "r1"},
    {"role": "user", "content": "C"},
]


def test_h7_3_thinking_mode_drops_historical_reasoning() -> None:
    prompt = encode_messages(HISTORY_ABC, thinking=True)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\n<｜User｜>A<｜Assistant｜></think>B<｜end▁of▁sentence｜>"
        "<｜User｜>C<｜Assistant｜><think>"
    )


def test_h7_4_chat_mode_history() -> None:
    prompt = encode_messages(HISTORY_ABC, thinking=False)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜User｜>A<｜Assistant｜></think>B<｜end▁of▁sentence｜><｜User｜>C"
        "<｜Assistant｜></think>"
    )


def test_h7_5_chat_mode_tools_on_system_and_tool_call_history() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "W?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("call_1", "get_weather", '{"city": "Paris", "days": 2}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = encode_messages(messages, thinking=False, tools=[WEATHER_TOOL])
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>S\n\n"
        + TOOLS_HEADER
        + WEATHER_SCHEMA_LINE
        + TOOLS_FOOTER
        + '<｜User｜>W?<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result>"
        "<｜Assistant｜></think>"
    )


def test_h7_6_thinking_with_tools_keeps_history_reasoning_and_merges_tool_result_with_user() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "reasoning_content": "R",
            "content": "",
            "tool_calls": [call("c1", "f", {"q": "x", "n": [1, 2], "o": {"k": True}})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "res"},
        {"role": "user", "content": "more"},
    ]
    prompt = encode_messages(messages, thinking=True, tools=[F_TOOL])
    tail = (
        '<｜User｜>go<｜Assistant｜><think>R</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="q" string="true">x</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">[1, 2]</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="o" string="false">{"k": true}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>res</tool_result>\n\nmore<｜Assistant｜><think>"
    )
    assert prompt.endswith(tail)
    # No system message: an empty one is inserted at index 0 to carry the tools.
    assert prompt == "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "\n\n" + TOOLS_HEADER + F_SCHEMA_LINE + (
        TOOLS_FOOTER + tail
    )


def test_h7_7_chat_mode_response_format_on_system() -> None:
    prompt = encode_messages(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        thinking=False,
        response_format={"type": "json_object"},
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>S\n\n## Response Format:\n\nYou MUST strictly adhere to the "
        'following schema to reply:\n{"type": "json_object"}<｜User｜>Q<｜Assistant｜></think>'
    )


def test_h7_8_thinking_continue_final_message_keeps_reasoning_open() -> None:
    prompt = encode_messages(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "reasoning_content": "partial"},
        ],
        thinking=True,
        continue_final_message=True,
    )
    assert prompt == B + "<｜System｜>" + EFFORT_75 + "<｜User｜>Q<｜Assistant｜><think>partial"


def test_h7_9_chat_mode_mid_conversation_system_opens_assistant_turn() -> None:
    prompt = encode_messages(
        [
            {"role": "user", "content": "A"},
            {"role": "assistant", "content": "B"},
            {"role": "system", "content": "NEW"},
        ],
        thinking=False,
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜User｜>A<｜Assistant｜></think>B<｜end▁of▁sentence｜><｜System｜>NEW"
        "<｜Assistant｜></think>"
    )


# --- Tools block (H5) -----------------------------------------------------------------------------------


def test_tools_block_text_is_h5_verbatim_with_one_schema_line_per_tool() -> None:
    block = render_tools_block([WEATHER_TOOL["function"], F_TOOL["function"]])
    assert block == TOOLS_HEADER + WEATHER_SCHEMA_LINE + "\n" + F_SCHEMA_LINE + TOOLS_FOOTER
    assert block.endswith("tool calls.\n")


def test_tool_schema_keeps_key_order_and_non_ascii() -> None:
    tool = {"type": "function", "function": {"parameters": {}, "name": "météo", "description": "天气"}}
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=False, tools=[tool])
    assert '\n{"parameters": {}, "name": "météo", "description": "天气"}\n\n' in prompt


def test_empty_system_in_thinking_mode_gives_four_newlines_before_tools() -> None:
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=True, tools=[F_TOOL])
    assert prompt.startswith(
        B + "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n\n\n## Tools\n\n"
    )


def test_empty_system_in_chat_mode_puts_tools_right_after_system_tag() -> None:
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=False, tools=[F_TOOL])
    assert prompt == B + "<｜System｜>\n\n" + TOOLS_HEADER + F_SCHEMA_LINE + TOOLS_FOOTER + (
        "<｜User｜>x<｜Assistant｜></think>"
    )


def test_tools_attach_to_first_system_message_even_mid_conversation() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "system", "content": "NEW"},
        {"role": "system", "content": "LATER"},
    ]
    prompt = encode_messages(messages, thinking=False, tools=[F_TOOL])
    assert prompt == (
        B
        + "<｜User｜>A<｜Assistant｜></think>B"
        + E
        + "<｜System｜>NEW\n\n"
        + TOOLS_HEADER
        + F_SCHEMA_LINE
        + TOOLS_FOOTER
        + "<｜System｜>LATER<｜Assistant｜></think>"
    )


def test_empty_tools_list_counts_as_no_tools() -> None:
    assert encode_messages(HISTORY_ABC, thinking=True, tools=[]) == encode_messages(HISTORY_ABC, thinking=True)


def test_tools_and_response_format_share_one_inserted_system_message() -> None:
    prompt = encode_messages(
        [{"role": "user", "content": "x"}],
        thinking=False,
        tools=[F_TOOL],
        response_format={"type": "json_object"},
    )
    assert prompt == B + "<｜System｜>\n\n" + TOOLS_HEADER + F_SCHEMA_LINE + TOOLS_FOOTER + (
        '\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": '
        '"json_object"}<｜User｜>x<｜Assistant｜></think>'
    )


def test_non_function_tool_raises_value_error() -> None:
    with pytest.raises(ValueError, match="expected 'function'"):
        encode_messages([{"role": "user", "content": "x"}], thinking=False, tools=[{"type": "web_search"}])


# --- Response format ------------------------------------------------------------------------------------


def test_response_format_without_system_inserts_empty_system_at_index_0() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "ans", "schema": {"type": "object"}}}
    prompt = encode_messages([{"role": "user", "content": "Q"}], thinking=True, response_format=rf)
    assert prompt == (
        B
        + "<｜System｜>"
        + EFFORT_75
        + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + '{"type": "json_schema", "json_schema": {"name": "ans", "schema": {"type": "object"}}}'
        + "<｜User｜>Q<｜Assistant｜><think>"
    )


def test_text_response_format_is_not_rendered() -> None:
    messages = [{"role": "user", "content": "Q"}]
    assert encode_messages(messages, thinking=False, response_format={"type": "text"}) == encode_messages(
        messages, thinking=False
    )


# --- drop_thinking (H2.5, H2.6) -------------------------------------------------------------------------


def test_drop_thinking_drops_developer_messages_and_reasoning_before_last_user_turn() -> None:
    messages = [
        {"role": "developer", "content": "D1"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
        {"role": "user", "content": "C"},
    ]
    prompt = encode_messages(messages, thinking=True)
    assert prompt == (
        B + "<｜System｜>" + EFFORT_75 + "<｜User｜>A<｜Assistant｜></think>B" + E + "<｜User｜>C<｜Assistant｜><think>"
    )
    assert "D1" not in prompt and "r1" not in prompt


def test_a_user_turn_of_tool_results_only_is_not_the_last_user_turn() -> None:
    """DeepSeek's released encoder: tool results continue the assistant's turn, so with thinking dropped the
    reasoning of the calls they answer stays, and the calls' turn is opened with ``<think>``."""
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": [call("c1", "f", {"q": "x"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "res"},
    ]
    prompt = encode_messages(messages, thinking=True)
    assert prompt == (
        B
        + "<｜System｜>"
        + EFFORT_75
        + '<｜User｜>go<｜Assistant｜><think>R</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        + '<｜DSML｜ parameter name="q" string="true">x</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
        + E
        + "<｜User｜><tool_result>res</tool_result><｜Assistant｜><think>"
    )
    # A user message after the results makes that merged turn a user turn again: the earlier reasoning goes.
    later = encode_messages([*messages, {"role": "user", "content": "more"}], thinking=True)
    assert "R</think>" not in later and later.endswith("<tool_result>res</tool_result>\n\nmore<｜Assistant｜><think>")


def test_drop_thinking_keeps_developer_message_that_is_the_last_user_turn() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
        {"role": "developer", "content": "D"},
    ]
    prompt = encode_messages(messages, thinking=True)
    assert prompt == (
        B + "<｜System｜>" + EFFORT_75 + "<｜User｜>A<｜Assistant｜></think>B" + E + "<｜User｜>D<｜Assistant｜><think>"
    )


def test_drop_thinking_keeps_reasoning_after_last_user_turn() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
    ]
    prompt = encode_messages(messages, thinking=True, add_generation_prompt=False)
    assert prompt == B + "<｜System｜>" + EFFORT_75 + "<｜User｜>A<｜Assistant｜><think>r1</think>B" + E


def test_drop_thinking_false_keeps_history_reasoning_and_developer_messages() -> None:
    messages = [
        {"role": "developer", "content": "D1"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
        {"role": "user", "content": "C"},
    ]
    prompt = encode_messages(messages, thinking=True, drop_thinking=False)
    assert prompt == (
        B
        + "<｜System｜>"
        + EFFORT_75
        + "<｜User｜>D1<｜User｜>A<｜Assistant｜><think>r1</think>B"
        + E
        + "<｜User｜>C<｜Assistant｜><think>"
    )


def test_tools_disable_drop_thinking() -> None:
    messages = [
        {"role": "developer", "content": "D1"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
        {"role": "user", "content": "C"},
    ]
    with_tools = encode_messages(messages, thinking=True, tools=[F_TOOL])
    assert with_tools == (
        B
        + "<｜System｜>"
        + EFFORT_75
        + "\n\n"
        + TOOLS_HEADER
        + F_SCHEMA_LINE
        + TOOLS_FOOTER
        + "<｜User｜>D1<｜User｜>A<｜Assistant｜><think>r1</think>B"
        + E
        + "<｜User｜>C<｜Assistant｜><think>"
    )


def test_history_without_reasoning_renders_empty_think_pair_when_thinking_is_kept() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    prompt = encode_messages(messages, thinking=True, drop_thinking=False)
    assert "<｜User｜>A<｜Assistant｜><think></think>B" + E in prompt


def test_mid_conversation_system_counts_as_last_user_turn_for_drop_thinking() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning_content": "r1"},
        {"role": "system", "content": "NEW"},
    ]
    prompt = encode_messages(messages, thinking=True)
    assert prompt == (
        B
        + "<｜System｜>"
        + EFFORT_75
        + "<｜User｜>A<｜Assistant｜></think>B"
        + E
        + "<｜System｜>NEW<｜Assistant｜><think>"
    )


def test_chat_mode_never_renders_reasoning() -> None:
    prompt = encode_messages(HISTORY_ABC, thinking=False, drop_thinking=False)
    assert "r1" not in prompt
    assert THINK_START not in prompt


# --- Tool messages (H2.2, H2.3) -------------------------------------------------------------------------


def test_tool_results_are_sorted_by_tool_call_order() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}"), call("c", "f", "{}")],
        },
        {"role": "tool", "tool_call_id": "c", "content": "RC"},
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
    ]
    prompt = encode_messages(messages, thinking=False)
    assert prompt.endswith(
        E + "<｜User｜><tool_result>RA</tool_result>\n\n<tool_result>RB</tool_result>\n\n"
        "<tool_result>RC</tool_result><｜Assistant｜></think>"
    )


def test_tool_results_merge_with_following_user_message_and_text_keeps_its_slot() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
        {"role": "user", "content": "note"},
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
    ]
    prompt = encode_messages(messages, thinking=False)
    assert prompt.endswith(
        E
        + "<｜User｜><tool_result>RA</tool_result>\n\nnote\n\n<tool_result>RB</tool_result>"
        + "<｜Assistant｜></think>"
    )
    assert prompt.count("<｜User｜>") == 2


def test_tool_result_with_unknown_id_sorts_as_first_call() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
        {"role": "tool", "tool_call_id": "zzz", "content": "RZ"},
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
    ]
    prompt = encode_messages(messages, thinking=False)
    # Unknown ids get position 0; the sort is stable, so RZ stays ahead of RA.
    assert prompt.endswith(
        "<｜User｜><tool_result>RZ</tool_result>\n\n<tool_result>RA</tool_result>\n\n"
        "<tool_result>RB</tool_result><｜Assistant｜></think>"
    )


def test_tool_results_sort_against_the_preceding_assistant_only() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}")]},
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
        {"role": "assistant", "content": "", "tool_calls": [call("y", "f", "{}"), call("x", "f", "{}")]},
        {"role": "tool", "tool_call_id": "x", "content": "RX"},
        {"role": "tool", "tool_call_id": "y", "content": "RY"},
    ]
    prompt = encode_messages(messages, thinking=False)
    assert "<｜User｜><tool_result>RA</tool_result>\n\n<tool_result>RB</tool_result><｜Assistant｜>" in prompt
    assert prompt.endswith(
        "<｜User｜><tool_result>RY</tool_result>\n\n<tool_result>RX</tool_result><｜Assistant｜></think>"
    )


def test_calls_without_an_id_do_not_place_results_and_a_repeated_id_places_by_its_last_call() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("a", "f", "{}"), call("", "f", "{}"), call("b", "f", "{}"), call("a", "f", "{}")],
        },
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
        {"role": "tool", "content": "R-none"},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
    ]
    # ids: a -> 3 (its last call), b -> 2; a result without an id sorts as position 0
    assert encode_messages(messages, thinking=False).endswith(
        "<｜User｜><tool_result>R-none</tool_result>\n\n<tool_result>RB</tool_result>\n\n"
        "<tool_result>RA</tool_result><｜Assistant｜></think>"
    )
    messages[1]["tool_calls"] = [call("a", "f", "{}"), call("", "f", "{}")]
    messages[2:] = [{"role": "tool", "content": "R-none"}, {"role": "tool", "tool_call_id": "a", "content": "RA"}]
    # the result without an id does not take the id-less call's place: both sort as position 0, in message order
    assert encode_messages(messages, thinking=False).endswith(
        "<｜User｜><tool_result>R-none</tool_result>\n\n<tool_result>RA</tool_result><｜Assistant｜></think>"
    )


def test_call_id_may_sit_on_the_function_object() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"id": "x", "name": "f", "arguments": "{}"}},
                {"type": "function", "function": {"id": "y", "name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "y", "content": "RY"},
        {"role": "tool", "tool_call_id": "x", "content": "RX"},
    ]
    assert encode_messages(messages, thinking=False).endswith(
        "<tool_result>RX</tool_result>\n\n<tool_result>RY</tool_result><｜Assistant｜></think>"
    )


def test_orphaned_results_after_a_reply_without_calls_sort_by_the_last_calls() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}")]},
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
        {"role": "assistant", "content": "meanwhile"},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
        {"role": "tool", "tool_call_id": "a", "content": "RA2"},
    ]
    assert encode_messages(messages, thinking=False).endswith(
        "meanwhile" + E + "<｜User｜><tool_result>RA2</tool_result>\n\n<tool_result>RB</tool_result>"
        "<｜Assistant｜></think>"
    )


def test_null_tool_content_renders_as_deepseeks_encoder_prints_it() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "f", "{}")]},
        {"role": "tool", "tool_call_id": "a", "content": None},
        {"role": "tool", "tool_call_id": "b"},
    ]
    assert encode_messages(messages, thinking=False).endswith(
        "<｜User｜><tool_result>None</tool_result>\n\n<tool_result></tool_result><｜Assistant｜></think>"
    )


def test_tool_result_list_content_is_flattened() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}")]},
        {
            "role": "tool",
            "tool_call_id": "a",
            "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}],
        },
    ]
    prompt = encode_messages(messages, thinking=False)
    assert prompt.endswith("<｜User｜><tool_result>p1\n\np2</tool_result><｜Assistant｜></think>")


def test_consecutive_user_messages_merge_into_one_user_turn() -> None:
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    assert encode_messages(messages, thinking=False) == B + "<｜User｜>one\n\ntwo<｜Assistant｜></think>"


# --- Assistant tool calls in DSML (H3) ------------------------------------------------------------------


def _render_single_call(arguments: object) -> str:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "f", arguments)]},
    ]
    prompt = encode_messages(messages, thinking=False, add_generation_prompt=False)
    prefix = B + "<｜User｜>go<｜Assistant｜></think>"
    assert prompt.startswith(prefix) and prompt.endswith(E)
    return prompt[len(prefix) : -len(E)]


def test_arguments_as_dict_and_json_string_render_identically() -> None:
    as_dict = _render_single_call({"city": "Paris", "days": 2})
    as_string = _render_single_call('{"city": "Paris", "days": 2}')
    assert (
        as_dict
        == as_string
        == dsml_calls(("f", [dsml_param("city", "Paris", string=True), dsml_param("days", "2", string=False)]))
    )


def test_double_encoded_json_string_arguments_are_decoded_twice() -> None:
    double = json.dumps(json.dumps({"city": "Paris"}))
    assert _render_single_call(double) == dsml_calls(("f", [dsml_param("city", "Paris", string=True)]))


def test_non_dict_arguments_are_wrapped_under_arguments_key() -> None:
    assert _render_single_call("[1, 2]") == dsml_calls(("f", [dsml_param("arguments", "[1, 2]", string=True)]))
    assert _render_single_call([1, 2]) == dsml_calls(("f", [dsml_param("arguments", "[1, 2]", string=False)]))
    assert _render_single_call("not json") == dsml_calls(("f", [dsml_param("arguments", "not json", string=True)]))


def test_triple_encoded_arguments_stay_wrapped_as_the_original_string() -> None:
    triple = json.dumps(json.dumps(json.dumps({"a": 1})))
    assert decode_tool_arguments(triple) == {"arguments": triple}


def test_parameter_values_strings_are_raw_and_others_are_json_with_default_separators() -> None:
    arguments = {"s": 'a<b>"c"\n', "i": 3, "f": 1.5, "b": False, "z": None, "u": {"名": ["é", 1]}}
    assert _render_single_call(arguments) == dsml_calls(
        (
            "f",
            [
                dsml_param("s", 'a<b>"c"\n', string=True),
                dsml_param("i", "3", string=False),
                dsml_param("f", "1.5", string=False),
                dsml_param("b", "false", string=False),
                dsml_param("z", "null", string=False),
                dsml_param("u", '{"名": ["é", 1]}', string=False),
            ],
        )
    )


def test_parallel_tool_calls_render_as_invokes_in_one_calls_block() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("a", "f", {"q": "x"}), call("b", "g", "{}")],
        },
    ]
    prompt = encode_messages(messages, thinking=False, add_generation_prompt=False)
    assert prompt == (
        B
        + "<｜User｜>go<｜Assistant｜></think>Let me check."
        + dsml_calls(("f", [dsml_param("q", "x", string=True)]), ("g", []))
        + E
    )
    assert '<｜DSML｜ invoke name="g">\n\n</｜DSML｜ invoke>' in prompt


def test_malformed_tool_call_raises_value_error() -> None:
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [{"id": "a"}]}]
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        encode_messages(messages, thinking=False)


# --- Reasoning effort (H3) ------------------------------------------------------------------------------


RELEASED_EFFORTS = [(None, 75), ("low", 50), ("high", 75), ("xhigh", 75), ("max", 100), (1, 1), (42, 42), (100, 100)]
"""DeepSeek's released V4.1 table (encoding/encoding.py of the checkpoint, and vLLM 0.33.0): None is ``high``."""


@pytest.mark.parametrize(("effort", "value"), RELEASED_EFFORTS)
def test_effort_value_maps_named_and_integer_efforts(effort: str | int | None, value: int) -> None:
    assert effort_value(effort) == value


@pytest.mark.parametrize(("effort", "value"), RELEASED_EFFORTS)
def test_golden_prompt_for_each_effort(effort: str | int | None, value: int) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    prompt = encode_messages(messages, thinking=True, reasoning_effort=effort)
    assert prompt == (
        f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {value} (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\nS<｜User｜>Hi<｜Assistant｜><think>"
    )


@pytest.mark.parametrize("effort", ["medium", "minimal", "none", "HIGH", 0, 101, -5, True, 50.0, "50"])
def test_effort_value_rejects_anything_else_naming_the_allowed_values(effort: object) -> None:
    with pytest.raises(ValueError, match="'low', 'high', 'xhigh', 'max' or an integer from 1 to 100"):
        effort_value(effort)  # type: ignore[arg-type]


def test_effort_prefix_prints_mapped_value_in_thinking_mode() -> None:
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="max")
    assert prompt == (
        B + "<｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n<｜User｜>x<｜Assistant｜><think>"
    )


def test_encode_rejects_medium_effort_in_thinking_mode() -> None:
    with pytest.raises(ValueError, match="invalid reasoning_effort 'medium'"):
        encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="medium")


def test_chat_mode_ignores_reasoning_effort() -> None:
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=False, reasoning_effort="medium")
    assert prompt == B + "<｜User｜>x<｜Assistant｜></think>"


# --- Content and roles (H6) -----------------------------------------------------------------------------


def test_list_content_text_parts_are_joined_by_blank_line_and_images_become_placeholders() -> None:
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_image", "image_url": "https://x/y.png"},
        {"type": "text", "text": "what?"},
    ]
    prompt = encode_messages([{"role": "user", "content": content}], thinking=False)
    assert (
        prompt == B + "<｜User｜>look\n\n<｜deepseek_image｜>\n\n<｜deepseek_image｜>\n\nwhat?<｜Assistant｜></think>"
    )
    assert IMAGE_PLACEHOLDER == "<｜deepseek_image｜>"


def test_list_content_flattening_applies_to_system_and_assistant() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": [{"type": "text", "text": "A1"}]},
    ]
    prompt = encode_messages(messages, thinking=False, add_generation_prompt=False)
    assert prompt == B + "<｜System｜>S1\n\nS2<｜User｜>U<｜Assistant｜></think>A1" + E


def test_unsupported_content_part_raises_value_error() -> None:
    content = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    with pytest.raises(ValueError, match="unsupported content part type 'input_audio'"):
        encode_messages([{"role": "user", "content": content}], thinking=False)


def test_none_content_renders_as_empty() -> None:
    """DeepSeek's encoder fails on a null user content (a TypeError); the API refuses it first (400, OpenAI's
    rule), and the encoder renders it as empty for callers inside the gateway."""
    assert (
        encode_messages([{"role": "user", "content": None}], thinking=False) == B + "<｜User｜><｜Assistant｜></think>"
    )


def test_unknown_role_raises_value_error() -> None:
    with pytest.raises(ValueError, match="unsupported role 'function'"):
        encode_messages([{"role": "function", "content": "x"}], thinking=False)


def test_developer_message_without_content_raises_value_error() -> None:
    with pytest.raises(ValueError, match="developer message without content"):
        encode_messages([{"role": "developer", "content": None}], thinking=False)


def test_developer_message_with_empty_text_is_encoded_like_an_empty_system_message() -> None:
    """Deliberate difference from DeepSeek's encoder, which asserts on it: OpenAI accepts an empty developer
    message (an agent with empty instructions sends one), and an empty turn changes nothing the model reads."""
    assert (
        encode_messages([{"role": "developer", "content": ""}], thinking=False)
        == B + "<｜User｜><｜Assistant｜></think>"
    )


def test_developer_message_renders_as_user_turn() -> None:
    messages = [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}]
    assert encode_messages(messages, thinking=False) == B + "<｜User｜>D<｜User｜>U<｜Assistant｜></think>"


def test_empty_message_list_raises_value_error() -> None:
    with pytest.raises(ValueError, match="at least one message"):
        encode_messages([], thinking=False)


def test_reasoning_field_is_used_as_reasoning_content() -> None:
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B", "reasoning": "r"}]
    prompt = encode_messages(messages, thinking=True, add_generation_prompt=False)
    assert prompt.endswith("<｜Assistant｜><think>r</think>B" + E)


def test_reasoning_alias_wins_over_reasoning_content_as_in_deepseeks_wrapper() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B", "reasoning": "alias", "reasoning_content": "other"},
    ]
    prompt = encode_messages(messages, thinking=True, add_generation_prompt=False)
    assert prompt.endswith("<think>alias</think>B" + E)
    messages[1]["reasoning"] = None  # a null alias does not erase the reasoning the client sent
    assert encode_messages(messages, thinking=True, add_generation_prompt=False).endswith("<think>other</think>B" + E)


# --- latest_reminder ------------------------------------------------------------------------------------


def test_latest_reminder_follows_the_assistant_header() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "today is Monday"}]
    prompt = encode_messages(messages, thinking=True)
    assert prompt == (
        B + "<｜System｜>" + EFFORT_75 + "<｜User｜>Q<｜Assistant｜><think><｜latest_reminder｜>today is Monday"
    )
    assert prompt_ends_in_thinking(prompt)


def test_latest_reminder_before_assistant_is_kept_in_history() -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "latest_reminder", "content": "R"},
        {"role": "assistant", "content": "B", "reasoning_content": "r"},
        {"role": "user", "content": "Q2"},
    ]
    prompt = encode_messages(messages, thinking=False)
    assert prompt == (
        B + "<｜User｜>Q<｜Assistant｜></think><｜latest_reminder｜>RB" + E + "<｜User｜>Q2<｜Assistant｜></think>"
    )


# --- Generation prompt and continue_final_message (H2.1, H4) --------------------------------------------


def test_add_generation_prompt_false_ends_after_last_user_turn() -> None:
    prompt = encode_messages([{"role": "user", "content": "Q"}], thinking=True, add_generation_prompt=False)
    assert prompt == B + "<｜System｜>" + EFFORT_75 + "<｜User｜>Q"


def test_add_bos_false_omits_bos() -> None:
    prompt = encode_messages([{"role": "user", "content": "Q"}], thinking=False, add_bos=False)
    assert prompt == "<｜User｜>Q<｜Assistant｜></think>"


def test_generation_prompt_after_final_assistant_opens_new_assistant_turn() -> None:
    """Deliberate difference from vLLM 0.33.0's encoder, which ends such a prompt at the EOS: OpenAI answers a
    conversation that ends with an assistant message with a new one, and the model needs a turn to write in."""
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]
    prompt = encode_messages(messages, thinking=False)
    assert prompt == B + "<｜User｜>Q<｜Assistant｜></think>B" + E + "<｜Assistant｜></think>"


def test_a_conversation_of_one_system_message_opens_an_assistant_turn() -> None:
    """Deliberate difference from vLLM 0.33.0's encoder, which ends at the system text: OpenAI answers a request
    made of a system message alone, so the prompt gives the model its turn."""
    assert encode_messages([{"role": "system", "content": "S"}], thinking=False) == (
        B + "<｜System｜>S<｜Assistant｜></think>"
    )


def test_continue_final_message_with_content_omits_eos_and_closes_reasoning() -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "The answer", "reasoning_content": "r"},
    ]
    prompt = encode_messages(messages, thinking=True, continue_final_message=True)
    assert prompt == B + "<｜System｜>" + EFFORT_75 + "<｜User｜>Q<｜Assistant｜><think>r</think>The answer"
    assert not prompt_ends_in_thinking(prompt)


def test_continue_final_message_reasoning_only_keeps_think_open() -> None:
    """DeepSeek's reference encoder keeps the reasoning open; vLLM 0.33.0's copy has no continue_final_message
    and closes it (``</think>`` + EOS): continuing the reasoning is the point of the option."""
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "reasoning": "step 1"},
    ]
    prompt = encode_messages(messages, thinking=True, continue_final_message=True)
    assert prompt.endswith("<｜User｜>Q<｜Assistant｜><think>step 1")
    assert THINK_END not in prompt
    assert prompt_ends_in_thinking(prompt)


def test_continue_final_message_reasoning_with_tool_calls_closes_reasoning() -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call("a", "f", {})]},
    ]
    prompt = encode_messages(messages, thinking=True, continue_final_message=True)
    assert prompt.endswith("<｜Assistant｜><think>r</think>" + dsml_calls(("f", [])))
    assert not prompt.endswith(E)


def test_continue_final_message_without_reasoning_closes_empty_think() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]
    prompt = encode_messages(messages, thinking=True, continue_final_message=True)
    assert prompt.endswith("<｜Assistant｜><think></think>")
    assert not prompt_ends_in_thinking(prompt)


def test_continue_final_message_in_chat_mode_ignores_reasoning() -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Par", "reasoning_content": "r"},
    ]
    prompt = encode_messages(messages, thinking=False, continue_final_message=True)
    assert prompt == B + "<｜User｜>Q<｜Assistant｜></think>Par"


def test_continue_final_message_overrides_add_generation_prompt() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Par"}]
    prompt = encode_messages(messages, thinking=False, continue_final_message=True, add_generation_prompt=True)
    assert prompt.endswith("</think>Par")


def test_continue_final_message_without_final_assistant_raises_value_error() -> None:
    with pytest.raises(ValueError, match="continue_final_message requires the last message"):
        encode_messages([{"role": "user", "content": "Q"}], thinking=False, continue_final_message=True)


# --- prompt_ends_in_thinking ----------------------------------------------------------------------------


def test_prompt_ends_in_thinking_follows_generation_tag() -> None:
    assert prompt_ends_in_thinking(encode_messages(HISTORY_ABC, thinking=True))
    assert not prompt_ends_in_thinking(encode_messages(HISTORY_ABC, thinking=False))
    assert not prompt_ends_in_thinking(encode_messages(HISTORY_ABC, thinking=True, add_generation_prompt=False))
    assert not prompt_ends_in_thinking("")
    assert prompt_ends_in_thinking(USER + "x" + ASSISTANT + THINK_START)
    assert not prompt_ends_in_thinking(USER + "x" + ASSISTANT + THINK_START + "r" + THINK_END + "done" + EOS)


# --- Immutability ---------------------------------------------------------------------------------------


def test_inputs_are_not_mutated() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "r",
            "tool_calls": [call("b", "f", '{"x": 1}'), call("a", "f", {"y": [1]})],
        },
        {"role": "tool", "tool_call_id": "a", "content": "RA"},
        {"role": "tool", "tool_call_id": "b", "content": "RB"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "more"},
    ]
    tools = [F_TOOL, WEATHER_TOOL]
    response_format = {"type": "json_object"}
    snapshot = copy.deepcopy((messages, tools, response_format))
    first = encode_messages(messages, thinking=True, tools=tools, response_format=response_format, reasoning_effort=70)
    encode_messages(messages, thinking=True)
    assert (messages, tools, response_format) == snapshot
    assert (
        encode_messages(messages, thinking=True, tools=tools, response_format=response_format, reasoning_effort=70)
        == first
    )
    assert BOS == B and EOS == E

"""The V4.1 chat template's decisions per request: thinking mode and effort, tools, tool_choice, response_format."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import ChatPrompt
from backends.errors import InvalidRequestError
from backends.interface import GenerateRequest
from backends.reference import ReferenceArtifacts

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "r", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
}
CHAT_TAIL = "<｜Assistant｜></think>"
THINK_TAIL = "<｜Assistant｜><think>"


def render(artifacts: ReferenceArtifacts, default_thinking: bool = False, **fields: Any) -> ChatPrompt:
    request = GenerateRequest(request_id="r", model="m", messages=fields.pop("messages", USER), **fields)
    return DeepSeekV41ChatTemplate(default_thinking=default_thinking).render(request, artifacts.tokenizer)


def effort_line(value: int) -> str:
    return f"Reasoning Effort: {value} (range 1-100"


def test_chat_mode_by_default_and_thinking_when_the_backend_defaults_to_it(artifacts: ReferenceArtifacts) -> None:
    assert render(artifacts).text.endswith(CHAT_TAIL)
    thinking = render(artifacts, default_thinking=True)
    assert thinking.text.endswith(THINK_TAIL) and effort_line(75) in thinking.text


@pytest.mark.parametrize(
    ("effort", "value"),
    [("minimal", 50), ("low", 50), ("medium", 75), ("high", 75), ("xhigh", 75), ("max", 100), ("ultra", 100), (37, 37)],
)
def test_reasoning_effort_turns_thinking_on_with_deepseeks_mapping(
    artifacts: ReferenceArtifacts, effort: str | int, value: int
) -> None:
    text = render(artifacts, reasoning_effort=effort).text
    assert text.endswith(THINK_TAIL) and effort_line(value) in text


def test_none_effort_means_chat_mode_even_with_a_thinking_switch(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, default_thinking=True, reasoning_effort="none", chat_template_kwargs={"thinking": True})
    assert prompt.text.endswith(CHAT_TAIL)


@pytest.mark.parametrize("switch", ["thinking", "enable_thinking"])
def test_chat_template_kwargs_switch_thinking_either_way(artifacts: ReferenceArtifacts, switch: str) -> None:
    assert render(artifacts, chat_template_kwargs={switch: True}).text.endswith(THINK_TAIL)
    off = render(artifacts, default_thinking=True, reasoning_effort="high", chat_template_kwargs={switch: False})
    assert off.text.endswith(CHAT_TAIL)


@pytest.mark.parametrize("effort", ["medium-ish", "HIGH", 0, 101, True, 2.5])
def test_invalid_effort_is_an_invalid_request_naming_reasoning_effort(
    artifacts: ReferenceArtifacts, effort: object
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        render(artifacts, reasoning_effort=effort)
    assert caught.value.param == "reasoning_effort"


def test_unknown_chat_template_kwarg_is_an_invalid_request(artifacts: ReferenceArtifacts) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        render(artifacts, chat_template_kwargs={"add_vision_id": True})
    assert caught.value.param == "chat_template_kwargs.add_vision_id"


def test_thinking_prompt_starts_the_parser_in_reasoning(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, reasoning_effort="low")
    assert prompt.parser is not None and prompt.parser().in_reasoning
    chat = render(artifacts)
    assert chat.parser is not None and not chat.parser().in_reasoning
    assert render(artifacts).reasoning_end_token == artifacts.special.think_end


def test_tools_go_into_the_prompt_and_their_calls_are_parsed_without_constraint(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, tools=[WEATHER])
    assert "## Tools" in prompt.text and '"name": "get_weather"' in prompt.text
    assert prompt.so_args is None
    assert prompt.parser is not None
    parsed = prompt.parser().push('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">')
    assert parsed.tool_calls and parsed.tool_calls[0].name == "get_weather"


def test_tool_choice_none_leaves_tools_out_and_dsml_as_text(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, tools=[WEATHER], tool_choice="none")
    assert "## Tools" not in prompt.text and prompt.so_args is None
    assert prompt.parser is not None
    assert prompt.parser().push("<｜DSML｜ calls>").content == "<｜DSML｜ calls>"


def test_required_tool_choice_constrains_output_to_a_call_of_any_tool(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, tools=[WEATHER, CLOCK], tool_choice="required")
    assert prompt.so_args is not None and prompt.so_args["schema_type"] == "ebnf"
    assert "get_weather" in prompt.so_args["schema"] and '\\"now\\"' in prompt.so_args["schema"]
    assert "trigger_token_ids" not in prompt.so_args  # chat mode: the constraint starts at once
    assert prompt.so_param == "tool_choice"


def test_named_tool_choice_constrains_output_to_that_tool_only(artifacts: ReferenceArtifacts) -> None:
    choice = {"type": "function", "function": {"name": "now"}}
    prompt = render(artifacts, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert prompt.so_args is not None
    assert '\\"now\\"' in prompt.so_args["schema"] and "get_weather" not in prompt.so_args["schema"]
    assert "## Tools" in prompt.text and "get_weather" not in prompt.text  # as deepseek-recipe: the named tool only


def test_in_thinking_mode_constraints_start_after_the_reasoning(artifacts: ReferenceArtifacts) -> None:
    forced = render(artifacts, tools=[WEATHER], tool_choice="required", reasoning_effort="high")
    assert forced.so_args is not None and forced.so_args["trigger_token_ids"] == [artifacts.special.think_end]
    formatted = render(artifacts, response_format=SCHEMA_FORMAT, reasoning_effort="high")
    assert formatted.so_args is not None and formatted.so_args["trigger_token_ids"] == [artifacts.special.think_end]


def test_parallel_tool_calls_false_allows_one_call(artifacts: ReferenceArtifacts) -> None:
    forced = render(artifacts, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert forced.so_args is not None and "next-call" not in forced.so_args["schema"].split("\n")[0]
    auto = render(artifacts, tools=[WEATHER], parallel_tool_calls=False)
    assert auto.parser is not None
    parser = auto.parser()
    invoke = '<｜DSML｜ invoke name="get_weather">\n</｜DSML｜ invoke>'
    parsed = parser.push("<｜DSML｜ calls>" + invoke + invoke + "</｜DSML｜ calls>")
    assert [c.index for c in parsed.tool_calls] == [0]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": 5}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
            "response_format",
        ),
    ],
)
def test_bad_tool_and_format_requests_are_invalid_requests_naming_the_field(
    artifacts: ReferenceArtifacts, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        render(artifacts, **fields)
    assert caught.value.param == param


def test_response_format_goes_into_the_prompt_and_the_engine_constraint(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, response_format=SCHEMA_FORMAT)
    schema = json.dumps(SCHEMA_FORMAT["json_schema"]["schema"])
    assert "## Response Format:" in prompt.text and schema in prompt.text  # the schema, as deepseek-recipe writes it
    assert prompt.so_args == {"schema_type": "json", "schema": json.dumps(SCHEMA_FORMAT["json_schema"]["schema"])}
    assert prompt.so_param == "response_format"


def test_response_format_with_tool_choice_none_keeps_tools_out(artifacts: ReferenceArtifacts) -> None:
    prompt = render(artifacts, response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="none")
    assert prompt.so_args is not None and "## Tools" not in prompt.text


def test_tool_call_history_renders_and_tool_results_merge_into_the_user_turn(artifacts: ReferenceArtifacts) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = render(artifacts, messages=history, tools=[WEATHER]).text
    assert '<｜DSML｜ parameter name="city" string="true">P</｜DSML｜ parameter>' in text
    assert text.endswith("<｜User｜><tool_result>sunny</tool_result>" + CHAT_TAIL)


def test_a_forced_call_is_served_in_chat_mode_unless_the_request_asks_for_thinking(
    artifacts: ReferenceArtifacts,
) -> None:
    """OpenAI-semantics clients (instructor, LangChain, the Agents SDK) force calls and read them at once."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert render(artifacts, default_thinking=True, tools=[WEATHER], tool_choice=choice).text.endswith(CHAT_TAIL)
        asked = render(artifacts, default_thinking=True, tools=[WEATHER], tool_choice=choice, thinking=True)
        assert asked.text.endswith(THINK_TAIL)
    assert render(artifacts, default_thinking=True, tools=[WEATHER], tool_choice="auto").text.endswith(THINK_TAIL)

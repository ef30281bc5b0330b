"""DeepSeek V4.1 chat for in-process engines (DeepInfer and the reference engine): the request side.

One place decides, per chat request, everything that depends on the model family: thinking or chat mode and the
reasoning effort, which tools go into the prompt and how tool calls are parsed back, and the engine's
structured-output arguments (``so_args``) for ``response_format`` and forced tool calls. Client mistakes are
``InvalidRequestError``s naming the request field (a 400 for the client).

Thinking mode is on when the request asks for it: a ``reasoning_effort`` other than ``none``/``minimal``, or
``chat_template_kwargs`` ``thinking`` / ``enable_thinking`` (vLLM's switches; they win over the effort being set,
except that effort ``none``/``minimal`` always means chat mode). Otherwise the backend's ``default_thinking``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from backends.deepseek.effort import v41_effort
from backends.deepseek.encoding import encode_messages, prompt_ends_in_thinking
from backends.deepseek.markers import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
    THINK_END,
    THINK_START,
)
from backends.deepseek.parser import DeepSeekV41OutputParser, tool_schemas
from backends.deepseek.response_format import response_format_so_args
from backends.deepseek.schema_checks import ConstraintLimitError, check_constraint_size, check_json_schema
from backends.deepseek.tool_call_grammar import ToolSchemaError, tool_call_grammar
from backends.engine.prompts import ChatPrompt
from backends.errors import InvalidRequestError
from backends.interface import REQUEST_FEATURES, GenerateRequest

OUTPUT_MARKERS = (
    THINK_START,
    THINK_END,
    DSML_CALLS_START,
    DSML_CALLS_END,
    DSML_INVOKE_START,
    DSML_INVOKE_END,
    DSML_PARAMETER_START,
    DSML_PARAMETER_END,
)
"""The tags the output parser reads: the detokenizer keeps them in the text even where V4.1's tokenizer marks
them (or pieces of them, such as ``｜DSML｜``) as special tokens, while other special tokens are dropped."""

THINKING_SWITCHES = ("thinking", "enable_thinking")
CHAT_TEMPLATE_KWARGS = frozenset({*THINKING_SWITCHES, "drop_thinking"})


class DeepSeekV41ChatTemplate:
    """Renders chat requests in the V4.1 format and says how to decode and parse their output."""

    features = frozenset(REQUEST_FEATURES)
    output_markers: Sequence[str] = OUTPUT_MARKERS

    def __init__(self, *, default_thinking: bool = False) -> None:
        self.default_thinking = default_thinking
        self._think_end_ids: dict[int, list[int]] = {}

    def render(self, request: GenerateRequest, tokenizer: Tokenizer) -> ChatPrompt:
        assert request.messages is not None
        thinking, effort = self.thinking_mode(request)
        kwargs = request.chat_template_kwargs or {}
        tools = request.tools or None
        _check_tool_schemas(tools)
        choice, forced = _tool_choice(request.tool_choice, tools)
        prompt_tools = tools if choice != "none" else None

        try:
            so_args = response_format_so_args(request.response_format)
        except ConstraintLimitError as exc:
            raise InvalidRequestError(str(exc), param=exc.path) from None
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="response_format") from None
        so_param = "response_format" if so_args is not None else None
        if so_args is not None and prompt_tools is not None:
            raise InvalidRequestError(
                "response_format cannot be combined with tools unless tool_choice is 'none': the output constraint "
                "would make tool calls impossible",
                param="response_format",
            )
        single_call = request.parallel_tool_calls is False
        if forced is not None:
            assert tools is not None, "a forced call is among the request's tools"
            _check_forced_sizes(forced, tools)
            try:
                grammar = tool_call_grammar([tool["function"] for tool in forced], parallel=not single_call)
            except ToolSchemaError as exc:
                where = f"tools[{tools.index(forced[exc.index])}].function.parameters"
                if exc.where:
                    where += "." + exc.where
                raise InvalidRequestError(f"{where}: {exc}", param=where) from None
            so_args, so_param = {"schema_type": "ebnf", "schema": grammar}, "tool_choice"

        try:
            text = encode_messages(
                request.messages,
                thinking=thinking,
                reasoning_effort=effort,
                tools=prompt_tools,
                response_format=request.response_format,
                drop_thinking=bool(kwargs.get("drop_thinking", True)),
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="tools" if "tools[" in str(exc) else "messages") from exc

        in_reasoning = prompt_ends_in_thinking(text)
        think_end = self._think_end(tokenizer)
        if so_args is not None and in_reasoning:
            so_args["trigger_token_ids"] = think_end  # reasoning stays free; the constraint starts after it
        parser = functools.partial(
            DeepSeekV41OutputParser,
            in_reasoning=in_reasoning,
            tools=tool_schemas(prompt_tools) if prompt_tools is not None else None,
            max_calls=1 if single_call else None,
            literal_content=so_param == "response_format",
        )
        return ChatPrompt(
            text,
            parser=parser,
            so_args=so_args,
            so_param=so_param,
            reasoning_end_token=think_end[0] if len(think_end) == 1 else None,
        )

    def thinking_mode(self, request: GenerateRequest) -> tuple[bool, str | int | None]:
        """(thinking on, V4.1 effort) for a request; raises for an invalid effort or unknown template kwargs."""
        kwargs = request.chat_template_kwargs or {}
        for key in kwargs:
            if key not in CHAT_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{key} is not supported; accepted keys: "
                    f"{', '.join(sorted(CHAT_TEMPLATE_KWARGS))}",
                    param=f"chat_template_kwargs.{key}",
                )
        try:
            effort = v41_effort(request.reasoning_effort)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="reasoning_effort") from None
        if request.reasoning_effort is not None and effort is None:  # none / minimal
            return False, None
        for key in THINKING_SWITCHES:
            if key in kwargs:
                return bool(kwargs[key]), effort
        if request.reasoning_effort is not None:
            return True, effort
        if request.thinking is not None:
            return request.thinking, effort
        return self.default_thinking, effort

    def _think_end(self, tokenizer: Tokenizer) -> list[int]:
        """Token ids of ``</think>`` (one token in V4.1's vocabulary), cached per tokenizer."""
        key = id(tokenizer)
        ids = self._think_end_ids.get(key)
        if ids is None:
            ids = self._think_end_ids[key] = list(tokenizer.encode(THINK_END, add_special_tokens=False).ids)
        return list(ids)


def _check_tool_schemas(tools: list[dict[str, Any]] | None) -> None:
    """Each tool's ``parameters`` must be a well-formed JSON Schema: a 400 naming the tool otherwise.

    (The structure of ``tools`` itself is checked by the encoder, which names what is wrong.)
    """
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("parameters") is not None:
            where = f"tools[{i}].function.parameters"
            try:
                check_json_schema(function["parameters"], where)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=where) from None


def _check_forced_sizes(forced: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
    """A forced call's schemas become a grammar: past the size limits they are a 400 naming where."""
    for tool in forced:
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            try:
                check_constraint_size(parameters, f"tools[{tools.index(tool)}].function.parameters")
            except ConstraintLimitError as exc:
                raise InvalidRequestError(str(exc), param=exc.path) from None


def _tool_choice(
    tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> tuple[str, list[dict[str, Any]] | None]:
    """(``none`` | ``auto`` | ``required`` | ``named``, the tools a call is forced among or None)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto"):
        return tool_choice, None
    if not tools:
        raise InvalidRequestError("tool_choice requires tools to be given", param="tool_choice")
    if tool_choice == "required":
        return "required", tools
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(name, str)
        or not isinstance(tool_choice, Mapping)
        or tool_choice.get("type", "function") != "function"
    ):
        raise InvalidRequestError(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    named = [tool for tool in tools if tool.get("function", {}).get("name") == name]
    if not named:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "named", named[:1]

"""DeepSeek V4.1 chat for in-process engines (DeepInfer and the reference engine): the request side.

One place decides, per chat request, everything that depends on the model family: thinking or chat mode and the
reasoning effort, which tools go into the prompt and how tool calls are parsed back, and the engine's
structured-output arguments (``so_args``) for ``response_format`` and forced tool calls. The prompt itself, text
and token ids, is deepseek-recipe's (``conversation``, ``prompt_encoding``): client text never becomes a control
token. Client mistakes are ``InvalidRequestError``s naming the request field (a 400 for the client).

Thinking mode, first rule that applies (DeepSeek's order, then vLLM's switches):

1. ``thinking`` (DeepSeek's ``{"type": "enabled"|"disabled"}``, Messages' ``thinking``) decides;
2. a ``reasoning_effort`` of ``none`` turns it off;
3. ``chat_template_kwargs`` ``thinking`` / ``enable_thinking`` (vLLM's switches) decide;
4. any other ``reasoning_effort`` turns it on;
5. otherwise the model's default (``default_thinking``), except that a forced ``tool_choice`` then turns it off:
   clients built on OpenAI's semantics (instructor, LangChain's structured output, the Agents SDK) force calls and
   expect them at once, and DeepSeek's API refuses forced calls in thinking mode. A request that asks for thinking
   and forces a call keeps both (the gateway's extension): the reasoning stays free and the grammar starts after it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from backends.deepseek.conversation import (
    ConversationError,
    LibraryEffort,
    LibraryToolChoice,
    image_sources,
    to_conversation,
)
from backends.deepseek.effort import DEFAULT_EFFORT, parse_effort
from backends.deepseek.markers import (
    ASSISTANT,
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
    EOS,
    THINK_END,
    THINK_START,
)
from backends.deepseek.parser import DeepSeekV41OutputParser, Stage, tool_schemas
from backends.deepseek.prompt_encoding import PromptEncoder
from backends.deepseek.response_format import response_format_so_args
from backends.deepseek.schema_checks import ConstraintLimitError, check_constraint_size, check_json_schema
from backends.deepseek.tool_call_grammar import ToolSchemaError, tool_call_grammar
from backends.engine.prompts import ChatPrompt
from backends.errors import InvalidRequestError
from backends.interface import REQUEST_FEATURES, GenerateRequest, SamplingOptions

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

THINKING_TEMPERATURE = 1.0
"""The temperature DeepSeek samples thinking mode at, whatever the request asks (deepseek-recipe, DeepSeek's API)."""


class DeepSeekV41ChatTemplate:
    """Renders chat requests in the V4.1 format and says how to decode and parse their output."""

    features = frozenset(REQUEST_FEATURES)
    output_markers: Sequence[str] = OUTPUT_MARKERS

    def __init__(self, *, default_thinking: bool = False) -> None:
        self.default_thinking = default_thinking
        self._encoders: dict[int, tuple[Tokenizer, PromptEncoder]] = {}
        self._encoders_lock = threading.Lock()
        self._think_end_ids: dict[int, list[int]] = {}

    def render(self, request: GenerateRequest, tokenizer: Tokenizer) -> ChatPrompt:
        assert request.messages is not None
        tools = request.tools or None
        _check_tool_schemas(tools)
        choice, forced = _tool_choice(request.tool_choice, tools)
        thinking, effort = self.thinking_mode(request, forced_call=forced is not None)
        prompt_tools = None if choice == "none" else (forced if choice == "named" else tools)

        so_args = _response_format_so_args(request.response_format, prompt_tools)
        so_param = "response_format" if so_args is not None else None
        single_call = request.parallel_tool_calls is False
        if forced is not None:
            assert tools is not None, "a forced call is among the request's tools"
            so_args, so_param = _forced_call_so_args(forced, tools, single_call=single_call), "tool_choice"

        # A forced call is rendered as "auto": the grammar writes the calls block the library would prefill.
        library_choice: LibraryToolChoice = "none" if choice == "none" else "auto"
        try:
            conversation = to_conversation(
                request.messages,
                thinking=thinking,
                effort=DEFAULT_EFFORT if isinstance(effort, int) else effort,
                tools=prompt_tools,
                tool_choice=library_choice,
                response_format=request.response_format,
                tools_offered=bool(tools),
            )
        except ConversationError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        text, ids = self._encoder(tokenizer).encode(
            conversation, effort_number=effort if isinstance(effort, int) and thinking else None
        )

        in_reasoning = prompt_ends_in_thinking(text)
        think_end = self._think_end(tokenizer)
        if so_args is not None and in_reasoning:
            so_args["trigger_token_ids"] = think_end  # reasoning stays free; the constraint starts after it
        continued = request.messages[-1].get("prefix") is True  # a prefix continuation keeps leading newlines
        parser = functools.partial(
            DeepSeekV41OutputParser,
            stage=_output_stage(in_reasoning=in_reasoning, continued=continued),
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
            token_ids=ids,
            image_sources=image_sources(conversation),
        )

    def thinking_mode(self, request: GenerateRequest, *, forced_call: bool = False) -> tuple[bool, LibraryEffort | int]:
        """(thinking on, effort) for a request (module docstring); raises for an invalid effort or template kwargs."""
        kwargs = request.chat_template_kwargs or {}
        for key, value in kwargs.items():
            if key not in CHAT_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{key} is not supported; accepted keys: "
                    f"{', '.join(sorted(CHAT_TEMPLATE_KWARGS))}",
                    param=f"chat_template_kwargs.{key}",
                )
            if key == "drop_thinking" and not value:
                raise InvalidRequestError(
                    "chat_template_kwargs.drop_thinking cannot be false: DeepSeek's V4.1 encoding always drops the "
                    "reasoning of turns before the last user message",
                    param="chat_template_kwargs.drop_thinking",
                )
        try:
            off, effort = parse_effort(request.reasoning_effort)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="reasoning_effort") from None
        chosen = effort if effort is not None else DEFAULT_EFFORT
        if request.thinking is not None:
            return request.thinking, chosen
        if off:
            return False, chosen
        for key in THINKING_SWITCHES:
            if key in kwargs:
                return bool(kwargs[key]), chosen
        if request.reasoning_effort is not None:
            return True, chosen
        return self.default_thinking and not forced_call, chosen

    def served_sampling(self, request: GenerateRequest) -> SamplingOptions:
        """In thinking mode DeepSeek samples at temperature 1.0 and ignores ``presence_penalty`` and
        ``frequency_penalty``, whatever the request says and without an error (deepseek-recipe's
        ``inference_options``, DeepSeek's API); outside it the request's own sampling."""
        forced = request.tool_choice == "required" or isinstance(request.tool_choice, Mapping)
        if not self.thinking_mode(request, forced_call=forced and bool(request.tools))[0]:
            return request.sampling
        return dataclasses.replace(
            request.sampling, temperature=THINKING_TEMPERATURE, presence_penalty=0.0, frequency_penalty=0.0
        )

    def bind_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Builds the library's encoding for the engine's tokenizer and warms it, before the first request."""
        self._encoder(tokenizer).encode(to_conversation([{"role": "user", "content": ""}], thinking=False, effort=None))
        self._think_end(tokenizer)

    def _encoder(self, tokenizer: Tokenizer) -> PromptEncoder:
        """deepseek-recipe's encoding for this engine tokenizer, built once per tokenizer (its JSON is parsed)."""
        key = id(tokenizer)
        with self._encoders_lock:
            entry = self._encoders.get(key)
            if entry is None or entry[0] is not tokenizer:
                entry = self._encoders[key] = (tokenizer, PromptEncoder(tokenizer))
            return entry[1]

    def _think_end(self, tokenizer: Tokenizer) -> list[int]:
        """Token ids of ``</think>`` (one token in V4.1's vocabulary), cached per tokenizer."""
        key = id(tokenizer)
        ids = self._think_end_ids.get(key)
        if ids is None:
            ids = self._think_end_ids[key] = list(tokenizer.encode(THINK_END, add_special_tokens=False).ids)
        return list(ids)


def prompt_ends_in_thinking(prompt: str) -> bool:
    """Whether generation starts inside reasoning, to pick the output parser's initial state.

    True when the last assistant header opened ``<think>`` and nothing after it closed the reasoning: a fresh
    thinking-mode prompt (``…<｜Assistant｜><think>``) or a ``prefix`` continuation whose reasoning has no
    ``</think>`` yet (``…<｜Assistant｜><think>partial``).
    """
    head = prompt.rfind(ASSISTANT)
    if head < 0:
        return False
    tail = prompt[head + len(ASSISTANT) :]
    return tail.startswith(THINK_START) and THINK_END not in tail and EOS not in tail


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


def _response_format_so_args(
    response_format: Mapping[str, Any] | None, prompt_tools: list[dict[str, Any]] | None
) -> dict[str, Any] | None:
    """The engine constraint for ``response_format``, refused alongside tools the prompt offers."""
    try:
        so_args = response_format_so_args(response_format)
    except ConstraintLimitError as exc:
        raise InvalidRequestError(str(exc), param=exc.path) from None
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="response_format") from None
    if so_args is not None and prompt_tools is not None:
        raise InvalidRequestError(
            "response_format cannot be combined with tools unless tool_choice is 'none': the output constraint "
            "would make tool calls impossible",
            param="response_format",
        )
    return so_args


def _forced_call_so_args(
    forced: list[dict[str, Any]], tools: list[dict[str, Any]], *, single_call: bool
) -> dict[str, Any]:
    """The grammar constraint that makes the output a call of the forced tools, errors naming the tool's schema."""
    _check_forced_sizes(forced, tools)
    try:
        grammar = tool_call_grammar([tool["function"] for tool in forced], parallel=not single_call)
    except ToolSchemaError as exc:
        where = f"tools[{tools.index(forced[exc.index])}].function.parameters"
        if exc.where:
            where += "." + exc.where
        raise InvalidRequestError(f"{where}: {exc}", param=where) from None
    return {"schema_type": "ebnf", "schema": grammar}


def _output_stage(*, in_reasoning: bool, continued: bool) -> Stage:
    """Where the output parser starts: in reasoning or content, continuing a prefix message or not."""
    if in_reasoning:
        return Stage.REASONING_CONTINUATION if continued else Stage.REASONING
    return Stage.CONTENT_CONTINUATION if continued else Stage.CONTENT

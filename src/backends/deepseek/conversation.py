"""A normalized chat request as deepseek-recipe's ``Conversation``: the library renders and encodes V4.1 prompts.

Chat Completions, Responses and Messages all reach the backends as OpenAI-shaped message dicts
(``GenerateRequest.messages``). This module turns them into the library's conversation model, the same one the
library's own converter builds from the equivalent DeepSeek-dialect Chat Completions body (the suite checks that
with the library as the oracle), so that DeepSeek's code, not ours, decides the prompt. What stays ours is what
the library's model cannot say (docs/deepseek.md lists each with its reason):

- ``developer`` messages become system messages (the library has no ``developer`` role);
- a message's ``reasoning`` (vLLM's name) is read as its ``reasoning_content``;
- a null tool result is an empty one (the library's converter refuses null content);
- a user message's ``image_url`` parts become the library's placeholder and image sources, as its converter
  makes them, each source's ``path`` naming the part in the client's own request (a part translated from
  Responses or Messages brings its ``path``), so the library's image errors name it;
- the response-format extensions: ``regex`` is the library's own ``response_regex``; ``ebnf`` has no prompt
  section (the grammar is enforced by the engine only).

Every client mistake is a ``ValueError`` whose first word is the parameter path it names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import deepseek_recipe as recipe

IMAGE_TOKEN = "<｜image｜>"
"""The library's spelling of an image placeholder in message text (its ``UserMessage`` default)."""
IMAGE_DETAILS = ("low", "high", "auto")
"""OpenAI's ``detail`` values; the library takes each as it is."""

ImageDetail = Literal["low", "high", "auto"]
LibraryEffort = Literal["low", "high", "xhigh", "max"]
LibraryToolChoice = Literal["auto", "none", "required"]


class ConversationError(ValueError):
    """A message or tool the library's conversation model cannot hold; ``param`` is the request path."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def to_conversation(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    effort: LibraryEffort | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: LibraryToolChoice = "auto",
    response_format: Mapping[str, Any] | None = None,
    tools_offered: bool = False,
) -> recipe.Conversation:
    """The library ``Conversation`` for a request's messages and prompt options.

    ``tools``: the tools the prompt shows; ``tools_offered``: whether the request has any (even with
    ``tool_choice: "none"``), since a ``prefix`` continuation is refused with tools, as by the library.
    """
    if not messages:
        raise ConversationError("messages", "must contain at least one message")
    formatted = response_format is not None and response_format.get("type", "text") != "text"
    _check_prefix(messages, tools_offered=tools_offered, formatted=formatted)
    converted = [
        _message(idx, message, thinking=thinking)
        for idx, message in enumerate(messages)
        if not (
            message.get("role") in ("system", "developer") and not _text(f"messages[{idx}]", message.get("content"))
        )
    ]  # an empty system message is left out, as the library's converter does
    definitions = [_tool(idx, tool) for idx, tool in enumerate(tools or ())]
    schema, regex, format_name = _response_format(response_format)
    try:  # only the response format can be refused here
        return recipe.Conversation(
            converted,
            thinking_mode=thinking,
            tools=definitions,
            tool_choice=tool_choice,
            reasoning_effort=effort if thinking else None,
            response_format=format_name,
            response_schema=schema,
            response_regex=regex,
        )
    except ValueError as exc:
        raise ConversationError("response_format", str(exc)) from None


def _check_prefix(messages: Sequence[Mapping[str, Any]], *, tools_offered: bool, formatted: bool) -> None:
    """``prefix: true`` continues the final assistant message, without tools or a response format (the library's
    rules)."""
    last = len(messages) - 1
    for idx, message in enumerate(messages):
        if message.get("prefix") is not True:
            continue
        if idx != last or message.get("role") != "assistant":
            raise ConversationError(
                f"messages[{idx}].prefix", "only the final message, an assistant one, can be continued"
            )
        if tools_offered or any(other.get("tool_calls") for other in messages):
            raise ConversationError(
                f"messages[{idx}].prefix", "a prefix continuation cannot be combined with tools or tool calls"
            )
        if formatted:
            raise ConversationError(
                f"messages[{idx}].prefix", "a prefix continuation cannot be combined with a response_format"
            )


def _message(idx: int, message: Mapping[str, Any], *, thinking: bool) -> recipe.Message:
    where = f"messages[{idx}]"
    role = message.get("role")
    if role == "user":
        return recipe.UserMessage(*_text_and_images(where, message.get("content")))
    content = _text(where, message.get("content"))
    if role in ("system", "developer"):
        return recipe.SystemMessage(content)
    if role == "tool":
        call_id = message.get("tool_call_id")
        return recipe.ToolMessage(content, None if call_id is None else str(call_id))
    if role == "assistant":
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ConversationError(f"{where}.reasoning_content", "must be a string")
        if not thinking:
            reasoning = None  # chat mode renders no reasoning; the library's converter drops it
        elif reasoning is None:
            reasoning = ""  # the library's converter fills it so (ReasoningContentBehavior.FillEmpty)
        calls = message.get("tool_calls") or ()
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise ConversationError(f"{where}.tool_calls", "must be a list")
        return recipe.AssistantMessage(
            content,
            reasoning,
            [_tool_call(f"{where}.tool_calls[{n}]", call) for n, call in enumerate(calls)] or None,
            prefix=message.get("prefix") is True,
        )
    raise ConversationError(
        f"{where}.role", f"unsupported role {role!r}; expected 'system', 'developer', 'user', 'assistant' or 'tool'"
    )


def _text(where: str, content: Any) -> str:
    """A message's text: a string, null, or text parts joined by a blank line (as the library's converter)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ConversationError(f"{where}.content", "must be a string, null or a list of content parts")
    pieces = []
    for n, part in enumerate(content):
        text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise ConversationError(f"{where}.content[{n}]", "only text parts are supported")
        pieces.append(text)
    return "\n\n".join(pieces)


def _text_and_images(where: str, content: Any) -> tuple[str, list[recipe.ImageSource]]:
    """A user message's text, with the library's placeholder where each image part was, and its image sources
    (each with ``path``: the part's location in the client's request, for error messages)."""
    if not isinstance(content, Sequence) or isinstance(content, str):
        return _text(where, content), []
    pieces: list[str] = []
    sources: list[recipe.ImageSource] = []
    for n, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "image_url":
            sources.append(_image_source(f"{where}.content[{n}]", part))
            pieces.append(IMAGE_TOKEN)
        else:
            text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ConversationError(f"{where}.content[{n}]", "only text and image_url parts are supported")
            pieces.append(text)
    return "\n\n".join(pieces), sources


def _image_source(where: str, part: Mapping[str, Any]) -> recipe.ImageSource:
    """The library's source for an ``image_url`` part; a part's own ``path`` (set by the Responses and Messages
    translations) names it in the client's terms."""
    path = part.get("path")
    path = path if isinstance(path, str) else where
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else None
    if not isinstance(url, str) or not url:
        raise ConversationError(f"{path}.image_url.url", "must be a non-empty string")
    detail = image.get("detail") if isinstance(image, Mapping) else None
    if detail is None:
        detail = "high"  # the library's converter's default
    if detail not in IMAGE_DETAILS:
        raise ConversationError(f"{path}.image_url.detail", "must be 'low', 'high' or 'auto'")
    detail = cast(ImageDetail, detail)
    if url.startswith("data:"):
        return recipe.DataUrlImageSource(url, detail, path=path)
    return recipe.UrlImageSource(url, detail, path=path)


def image_sources(conversation: recipe.Conversation) -> list[recipe.ImageSource]:
    """A conversation's image sources in the order of their placeholders in the prompt."""
    return [source for message in conversation.messages for source in message.image_sources]


def _tool_call(where: str, call: Any) -> recipe.ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ConversationError(f"{where}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}.function.name", "must be a non-empty string")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id")
    return recipe.ToolCall("" if call_id is None else str(call_id), name, arguments)


def _tool(idx: int, tool: Any) -> recipe.ToolDefinition:
    where = f"tools[{idx}]"
    if not isinstance(tool, Mapping):
        raise ConversationError(where, "must be an object")
    if tool.get("type", "function") != "function":
        raise ConversationError(f"{where}.type", f"unsupported tool type {tool.get('type')!r}; expected 'function'")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ConversationError(f"{where}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}.function.name", "must be a non-empty string")
    description = function.get("description")
    strict = function.get("strict")
    return recipe.ToolDefinition(
        name,
        description if isinstance(description, str) else None,
        function.get("parameters"),
        strict if isinstance(strict, bool) else None,
    )


def _response_format(
    response_format: Mapping[str, Any] | None,
) -> tuple[Any | None, str | None, Literal["text", "json_object"]]:
    """(response_schema, response_regex, response_format) of the library for an OpenAI ``response_format``."""
    kind = response_format.get("type") if response_format is not None else None
    if response_format is None or kind not in ("json_object", "json_schema", "regex"):
        return None, None, "text"  # text, and the ebnf extension (no prompt section: the engine enforces it)
    if kind == "json_object":
        return None, None, "json_object"
    if kind == "regex":
        return None, response_format.get("regex"), "text"
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    return ({"type": "object", "additionalProperties": True} if schema is None else schema), None, "text"

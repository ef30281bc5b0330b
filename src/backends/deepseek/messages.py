"""Chat messages as the V4.1 encoder reads them: the caller's OpenAI-shaped dicts validated into records (H6).

The caller's data is never mutated; every client mistake is a ``ValueError`` naming the message and field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.deepseek.dsml import ToolCall, decode_tool_arguments
from backends.deepseek.markers import IMAGE_PLACEHOLDER

ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
"""``latest_reminder`` is an encoder-level role for the gateway's own use; clients may send the other five."""

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil"})


@dataclass(frozen=True)
class Block:
    """One piece of a user turn: plain text, or the result of one tool call."""

    kind: str  # "text" | "tool_result"
    text: str
    tool_use_id: str = ""


@dataclass(frozen=True)
class Turn:
    """A validated message, detached from the caller's dict."""

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    blocks: tuple[Block, ...] = ()
    tools: tuple[Mapping[str, Any], ...] = ()
    response_format: Mapping[str, Any] | None = None


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """Validate a request's messages into turns; raises ``ValueError`` naming the first bad one."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(idx, msg) for idx, msg in enumerate(messages)]


def _normalize_message(idx: int, msg: Mapping[str, Any]) -> Turn:
    if not isinstance(msg, Mapping):
        raise ValueError(f"messages[{idx}] must be an object")
    role = msg.get("role")
    if role not in ALLOWED_ROLES:
        raise ValueError(
            f"messages[{idx}] has unsupported role {role!r}; expected one of "
            "'system', 'developer', 'user', 'assistant', 'tool'"
        )
    content = _flatten_content(idx, msg.get("content"))

    if role == "developer" and msg.get("content") is None:  # "" is fine, as for system (OpenAI accepts both)
        raise ValueError(f"messages[{idx}] is a developer message without content")

    if role == "assistant":
        reasoning = msg.get("reasoning")  # vLLM's name wins over reasoning_content, as in DeepSeek's wrapper
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"messages[{idx}].reasoning_content must be a string")
        raw_calls = msg.get("tool_calls") or ()
        if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, str):
            raise ValueError(f"messages[{idx}].tool_calls must be a list")
        calls = tuple(_normalize_tool_call(idx, n, call) for n, call in enumerate(raw_calls))
        return Turn(role=role, content=content, reasoning=reasoning, tool_calls=calls)

    if role == "tool":
        call_id = msg.get("tool_call_id")
        if "content" in msg and msg["content"] is None:
            content = "None"  # DeepSeek's encoder prints a null tool result as Python does
        return Turn(role=role, content=content, tool_call_id="" if call_id is None else str(call_id))

    return Turn(role=role, content=content)


def _flatten_content(idx: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"messages[{idx}].content must be a string, null or a list of content parts")
    pieces: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{idx}] has a text part without a string 'text'")
            pieces.append(text)
        elif kind in IMAGE_PART_TYPES:
            pieces.append(IMAGE_PLACEHOLDER)
        else:
            raise ValueError(
                f"messages[{idx}] has unsupported content part type {kind!r}; expected 'text' or one of "
                f"{', '.join(repr(t) for t in sorted(IMAGE_PART_TYPES))}"
            )
    return "\n\n".join(pieces)


def _normalize_tool_call(idx: int, n: int, call: Any) -> ToolCall:
    where = f"messages[{idx}].tool_calls[{n}]"
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} must be an object")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where} has no 'function' object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    call_id = call.get("id") or function.get("id")
    return ToolCall(
        id="" if call_id is None else str(call_id),
        name=name,
        arguments=decode_tool_arguments(function.get("arguments")),
    )


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> tuple[Mapping[str, Any], ...]:
    """Strip the OpenAI ``{"type": "function", "function": ...}`` wrapper, keeping key order."""
    if not tools:
        return ()
    functions = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{n}] must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{n}] has unsupported type {tool.get('type')!r}; expected 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"tools[{n}] has no 'function' object")
        functions.append(function)
    return tuple(functions)

"""Anthropic messages, content blocks and tool declarations, checked by hand and brought into canonical shape.

A Claude Code request is 50 KB of blocks, and one pass over plain dicts that brings each block into its canonical
shape (a string ``content`` is a list of one text block; ``cache_control`` and ``citations`` dropped) costs a
fraction of building nested pydantic models. Errors name the path below the field (``[2].content[0].type``).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.openai.parameters import TOOL_NAME, MissingParameter, ParameterError, UnsupportedParameter, shown

TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]+")
ROLES = ("user", "assistant", "system")
TOOL_FIELDS = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "cache_control",
        "strict",
        "input_examples",
        "defer_loading",
        "allowed_callers",
        "eager_input_streaming",
    }
)
"""A custom tool's fields. ``strict`` and ``eager_input_streaming`` change nothing here (forced calls follow the
schema anyway; a call's input is sent once it is final) and ``input_examples`` are not shown to the model."""
UNSUPPORTED_BLOCKS = {
    "document": "documents are not supported by this model; send their text",
    "search_result": "search_result blocks are not supported; send their text",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
    "web_fetch_tool_result": "server tools are not supported",
    "code_execution_tool_result": "server tools are not supported",
    "bash_code_execution_tool_result": "server tools are not supported",
    "text_editor_code_execution_tool_result": "server tools are not supported",
    "tool_search_tool_result": "server tools are not supported",
    "container_upload": "containers are not supported",
    "mcp_tool_use": "MCP servers are not supported",
    "mcp_tool_result": "MCP servers are not supported",
}
"""Content blocks Anthropic defines that these models or this gateway cannot take: a 400 that says so."""
BLOCKS_BY_ROLE = {
    "user": frozenset({"text", "image", "tool_result"}),
    "assistant": frozenset({"text", "thinking", "redacted_thinking", "tool_use"}),
    "system": frozenset({"text"}),
}
BLOCK_FIELDS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "image": frozenset({"type", "source", "cache_control"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}


def canonical_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ParameterError(where, "a message must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ParameterError(f"{where}.role", f"expected 'user', 'assistant' or 'system', got {shown(role)}")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise ParameterError(f"{where}.{extra[0]}", "unknown field in a message")
    if "content" not in message:
        raise MissingParameter(f"{where}.content", "a message needs content")
    content = message["content"]
    if isinstance(content, str):
        blocks = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        blocks = [canonical_block(block, f"{where}.content[{j}]", role) for j, block in enumerate(content)]
    else:
        raise ParameterError(f"{where}.content", "expected a string or a list of content blocks")
    return {"role": role, "content": blocks}


def canonical_block(block: Any, where: str, role: str) -> dict[str, Any]:
    """A content block in its canonical shape, or a ``ParameterError`` naming what is wrong with it."""
    kind = _block_kind(block, where, role)
    if kind == "text":
        return {"type": "text", "text": _string(block, "text", where)}
    if kind == "image":
        return {"type": "image", "url": _image_url(block.get("source"), f"{where}.source")}
    if kind == "thinking":
        return {
            "type": "thinking",
            "thinking": _string(block, "thinking", where),
            "signature": _string(block, "signature", where),
        }
    if kind == "redacted_thinking":
        return {"type": "redacted_thinking", "data": _string(block, "data", where)}
    if kind == "tool_use":
        return _tool_use_block(block, where)
    return _tool_result_block(block, where)


def _block_kind(block: Any, where: str, role: str) -> str:
    """The block's type once it is known to be an object of a type ``role`` may send, with only that type's fields."""
    if not isinstance(block, dict):
        raise ParameterError(where, "a content block must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise ParameterError(f"{where}.type", f"expected a string, got {shown(kind)}")
    if kind in UNSUPPORTED_BLOCKS:
        raise UnsupportedParameter(f"{where}.type", UNSUPPORTED_BLOCKS[kind])
    if kind not in BLOCKS_BY_ROLE[role]:
        allowed = ", ".join(sorted(BLOCKS_BY_ROLE[role]))
        raise ParameterError(f"{where}.type", f"a {role} message takes blocks of type {allowed}, not {shown(kind)}")
    extra = sorted(set(block) - BLOCK_FIELDS[kind])
    if extra:
        raise ParameterError(f"{where}.{extra[0]}", f"unknown field in a {kind} block")
    return kind


def _tool_use_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_use`` block: an id of safe characters, an object input, and only direct callers."""
    use_id = _string(block, "id", where)
    if not TOOL_USE_ID.fullmatch(use_id):
        raise ParameterError(f"{where}.id", "a tool_use id is letters, digits, underscores and dashes")
    if not isinstance(block.get("input"), dict):
        raise ParameterError(f"{where}.input", "expected an object")
    caller = block.get("caller")
    if caller is not None and caller != {"type": "direct"}:
        raise UnsupportedParameter(f"{where}.caller", "only direct tool calls are supported")
    return {"type": "tool_use", "id": use_id, "name": _string(block, "name", where), "input": block["input"]}


def _tool_result_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_result`` block with its content flattened to text and the tools it loaded listed."""
    content = block.get("content", "")
    references: list[str] = []  # tools a tool search loaded (``tool_reference`` blocks)
    if isinstance(content, list):
        content = "\n\n".join(
            _tool_result_part(part, f"{where}.content[{k}]", references) for k, part in enumerate(content)
        )
    elif not isinstance(content, str):
        raise ParameterError(f"{where}.content", "expected a string or a list of text blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise ParameterError(f"{where}.is_error", "expected true or false")
    return {
        "type": "tool_result",
        "tool_use_id": _string(block, "tool_use_id", where),
        "content": content,
        "is_error": is_error,
        "references": references,
    }


def _tool_result_part(part: Any, here: str, references: list[str]) -> str:
    """The text of one block of a tool result's content; a ``tool_reference`` also lands in ``references``."""
    if not isinstance(part, dict):
        raise ParameterError(here, "a content block must be an object")
    kind = part.get("type")
    if isinstance(kind, str) and kind in UNSUPPORTED_BLOCKS:
        raise UnsupportedParameter(f"{here}.type", UNSUPPORTED_BLOCKS[kind])
    if kind == "image":
        raise UnsupportedParameter(
            f"{here}.type", "images in tool results are not supported; send them in a user message"
        )
    if kind == "tool_reference":
        extra = sorted(set(part) - {"type", "tool_name", "cache_control"})
        if extra:
            raise ParameterError(f"{here}.{extra[0]}", "unknown field in a tool_reference block")
        references.append(_string(part, "tool_name", here))
        return f"Tool loaded: {part['tool_name']}"
    if kind != "text":
        raise ParameterError(f"{here}.type", f"expected 'text' or 'tool_reference', got {shown(kind)}")
    text: str = canonical_block(part, here, "user")["text"]
    return text


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if value is None and key not in block:
        raise MissingParameter(f"{where}.{key}", f"a {block.get('type')} block needs {key}")
    if not isinstance(value, str):
        raise ParameterError(f"{where}.{key}", "expected a string")
    return value


def check_custom_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict):
        raise ParameterError(where, "a tool must be an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise UnsupportedParameter(
            f"{where}.type", f"server tools ({shown(kind)}) are not supported; declare a custom tool with input_schema"
        )
    extra = sorted(set(tool) - TOOL_FIELDS)
    if extra:
        raise ParameterError(f"{where}.{extra[0]}", "unknown field in a tool")
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ParameterError(f"{where}.name", "must be 1-64 letters, digits, underscores or dashes")
    if "description" in tool and not isinstance(tool["description"], str):
        raise ParameterError(f"{where}.description", "expected a string")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise MissingParameter(f"{where}.input_schema", "a tool needs an input_schema (a JSON Schema object)")
    if schema.get("type") != "object":
        raise ParameterError(f"{where}.input_schema.type", f"expected 'object', got {shown(schema.get('type'))}")
    if not isinstance(tool.get("defer_loading", False), bool):
        raise ParameterError(f"{where}.defer_loading", "expected true or false")
    callers = tool.get("allowed_callers")
    if callers is not None and callers != ["direct"]:
        raise UnsupportedParameter(f"{where}.allowed_callers", "only direct tool calls are supported")


def check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """Anthropic's pairing of tool uses and results. Consecutive messages of one role are one turn; the turn after
    an assistant turn that used tools is a user turn that begins with one ``tool_result`` for each use (text comes
    after them), and a ``tool_result`` answers a ``tool_use`` of the assistant turn just before it."""
    turns: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []  # role, [(path, block)]
    for i, message in enumerate(messages):
        blocks = [(f"messages[{i}].content[{j}]", block) for j, block in enumerate(message["content"])]
        if turns and turns[-1][0] == message["role"]:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message["role"], blocks))
    uses: dict[str, str] = {}  # tool_use id -> where, for the assistant turn just before
    for role, blocks in turns:
        if role == "user":
            answered: set[str] = set()
            seen_text = False
            for where, block in blocks:
                if block["type"] != "tool_result":
                    seen_text = True
                    continue
                if block["tool_use_id"] not in uses:
                    raise ParameterError(
                        f"{where}.tool_use_id",
                        f"{shown(block['tool_use_id'])} answers no tool_use of the assistant turn before it",
                    )
                if seen_text:
                    raise ParameterError(where, "tool_result blocks come first in a user message, before any text")
                answered.add(block["tool_use_id"])
            missing = [use for use in uses if use not in answered]
        else:
            missing = list(uses)
        if missing:
            raise ParameterError(
                uses[missing[0]],
                f"tool_use id {shown(missing[0])} has no tool_result at the start of the next user message",
            )
        uses = {b["id"]: where for where, b in blocks if b["type"] == "tool_use"} if role == "assistant" else {}


IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_url(source: Any, where: str) -> str:
    """An image block's source as one URL: base64 data becomes a data URL (the backend decodes and checks it)."""
    if not isinstance(source, dict):
        raise ParameterError(where, "expected an object with a type of 'base64' or 'url'")
    kind = source.get("type")
    if kind == "base64":
        extra = sorted(set(source) - {"type", "media_type", "data"})
        if extra:
            raise ParameterError(f"{where}.{extra[0]}", "unknown field in a base64 image source")
        media = source.get("media_type")
        if media not in IMAGE_MEDIA_TYPES:
            raise ParameterError(f"{where}.media_type", f"expected one of {', '.join(IMAGE_MEDIA_TYPES)}")
        return f"data:{media};base64,{_string(source, 'data', where)}"
    if kind == "url":
        extra = sorted(set(source) - {"type", "url"})
        if extra:
            raise ParameterError(f"{where}.{extra[0]}", "unknown field in a url image source")
        return _string(source, "url", where)
    if kind == "file":
        raise UnsupportedParameter(f"{where}.type", "images by file_id are not supported; send base64 data")
    raise ParameterError(f"{where}.type", f"expected 'base64' or 'url', got {shown(kind)}")

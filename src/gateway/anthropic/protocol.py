"""The Messages API request bodies (``POST /v1/messages`` and ``/v1/messages/count_tokens``), validated once.

Content blocks are checked by hand rather than as nested pydantic models: a Claude Code request is 50 KB of
blocks, and one pass over plain dicts that brings each block into its canonical shape (a string ``content`` is a
list of one text block; ``cache_control`` and ``citations`` dropped) costs a fraction of building models. Errors
name the full path (``messages[2].content[0].type``), as on the OpenAI routes.

What Anthropic would refuse is refused (a final assistant message, as on models without prefill; a
``tool_result`` that answers no ``tool_use`` of the turn before; thinking with a forced tool; ``budget_tokens``
under 1024); fields of Anthropic's service that change nothing here are accepted and ignored (``cache_control``,
``metadata`` beyond ``user_id``, ``service_tier``, ``inference_geo``, ``diagnostics``); features this gateway
cannot honour are a 400 that names them (images and documents, server tools, MCP servers, containers,
``clear_tool_uses`` context edits, ``speed: "fast"``). Deferred tools (``defer_loading``) stay out of the prompt until a
``tool_reference`` in a tool result loads them, as Anthropic's tool search does.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from gateway.openai.parameters import (
    MAX_TOKENS_LIMIT,
    TOOL_NAME,
    EmptyArray,
    InvalidText,
    MissingParameter,
    ParameterError,
    UnsupportedParameter,
    shown,
    unencodable_text,
)

MIN_THINKING_BUDGET = 1024
MAX_STOP_SEQUENCES = 64
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
    "image": "images are not supported by this model; send text",
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
    "user": frozenset({"text", "tool_result"}),
    "assistant": frozenset({"text", "thinking", "redacted_thinking", "tool_use"}),
    "system": frozenset({"text"}),
}
BLOCK_FIELDS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}


class _Body(BaseModel):
    """Strict, like the OpenAI routes: no coercion of strings to numbers, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Metadata(_Body):
    user_id: str | None = Field(None, max_length=512)


class Thinking(_Body):
    type: Literal["enabled", "adaptive", "disabled", "between_tools"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized", "omitted"] | None = Field(
        None, description="summarized (default): the reasoning is returned in full; omitted: only its signature"
    )

    @model_validator(mode="after")
    def _budget_rules(self) -> Thinking:
        if self.type == "enabled":
            if self.budget_tokens is None:
                raise MissingParameter("budget_tokens", "thinking of type 'enabled' needs budget_tokens")
            if self.budget_tokens < MIN_THINKING_BUDGET:
                raise ParameterError("budget_tokens", f"must be at least {MIN_THINKING_BUDGET}")
        elif self.budget_tokens is not None:
            raise ParameterError("budget_tokens", f"thinking of type {shown(self.type)} takes no budget_tokens")
        if self.display is not None and self.type == "disabled":
            raise ParameterError("display", "thinking of type 'disabled' takes no display")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ContextManagement(_Body):
    edits: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("edits")
    @classmethod
    def _known_edits(cls, edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, edit in enumerate(edits):
            kind = edit.get("type")
            if kind == "clear_tool_uses_20250919":
                raise UnsupportedParameter(f"[{i}].type", "clearing tool uses is not supported")
            if kind != "clear_thinking_20251015":
                raise ParameterError(f"[{i}].type", f"expected 'clear_thinking_20251015', got {shown(kind)}")
            extra = sorted(set(edit) - {"type", "keep"})
            if extra:
                raise ParameterError(f"[{i}].{extra[0]}", "unknown field in a context edit")
            keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
            if keep != "all" and keep != {"type": "all"}:
                value = keep.get("value") if isinstance(keep, dict) else None
                if not (
                    isinstance(keep, dict) and keep.get("type") == "thinking_turns" and set(keep) == {"type", "value"}
                ):
                    raise ParameterError(f"[{i}].keep", 'expected "all" or {"type": "thinking_turns", "value": N}')
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ParameterError(f"[{i}].keep.value", "expected an integer of at least 1")
        return edits

    def thinking_turns_kept(self) -> int | None:
        """How many of the latest assistant turns keep their thinking (None: all)."""
        kept: int | None = None
        for edit in self.edits:
            keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
            if isinstance(keep, dict) and keep.get("type") == "thinking_turns":
                kept = keep["value"] if kept is None else min(kept, keep["value"])
        return kept


class _Conversation(_Body):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt and how the reply may look."""

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted; prefix caching is the engine's")
    speed: Literal["standard", "fast"] | None = None
    mcp_servers: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        where = unencodable_text(data)
        if where is not None:
            raise InvalidText(where)
        return data

    @field_validator("messages")
    @classmethod
    def _canonical_messages(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not value:
            raise EmptyArray("", "at least one message is required")
        return [_message(message, f"[{i}]") for i, message in enumerate(value)]

    @field_validator("system")
    @classmethod
    def _system_text(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            return [_block(block, f"[{i}]", "system") for i, block in enumerate(value)]
        return value

    @field_validator("tools")
    @classmethod
    def _custom_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        names: set[str] = set()
        for i, tool in enumerate(value or ()):
            _custom_tool(tool, f"[{i}]")
            if tool["name"] in names:
                raise ParameterError(f"[{i}].name", f"the tool {shown(tool['name'])} is given twice")
            names.add(tool["name"])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise ParameterError(".type", f"expected 'auto', 'any', 'tool' or 'none', got {shown(kind)}")
        allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
        if kind == "none":
            allowed = {"type"}
        extra = sorted(set(value) - allowed)
        if extra:
            raise ParameterError(f".{extra[0]}", f"unknown field in a tool_choice of type {shown(kind)}")
        if kind == "tool" and not isinstance(value.get("name"), str):
            raise MissingParameter(".name", "a tool_choice of type 'tool' needs the tool's name")
        if not isinstance(value.get("disable_parallel_tool_use", False), bool):
            raise ParameterError(".disable_parallel_tool_use", "expected true or false")
        return value

    @model_validator(mode="after")
    def _conversation_rules(self) -> _Conversation:
        last = self.messages[-1]
        if last["role"] == "assistant":
            raise UnsupportedParameter(
                f"messages[{len(self.messages) - 1}]",
                "this model does not support assistant message prefill: the conversation must end with a user message",
            )
        _check_tool_turns(self.messages)
        names = {tool["name"] for tool in self.tools or ()}
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message["content"]):
                for name in block.get("references", ()):
                    if name not in names:
                        where = f"messages[{i}].content[{j}]"
                        raise ParameterError(where, f"a tool_reference names {shown(name)}, which is not in tools")
        choice = self.tool_choice
        if choice is not None and choice["type"] in ("any", "tool"):
            if not self.tools:
                raise ParameterError("tool_choice", f"tool_choice {shown(choice['type'])} needs tools")
            if choice["type"] == "tool" and all(t["name"] != choice["name"] for t in self.tools):
                raise ParameterError("tool_choice.name", f"the tool {shown(choice['name'])} is not in tools")
            if self.thinking is not None and self.thinking.on:
                raise UnsupportedParameter(
                    "tool_choice",
                    "thinking may not be enabled when tool_choice forces tool use; use 'auto' or 'none'",
                )
        if self.speed == "fast":
            raise UnsupportedParameter("speed", "fast mode is not supported by this model")
        if self.mcp_servers:
            raise UnsupportedParameter("mcp_servers", "MCP servers are not supported")
        return self

    def reasoning_display_omitted(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: a message without the generation settings."""


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_SEQUENCES:
            raise ParameterError("", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        for i, sequence in enumerate(value or ()):
            if not sequence.strip():
                raise ParameterError(f"[{i}]", "each stop sequence must contain non-whitespace characters")
        return value

    @model_validator(mode="after")
    def _generation_rules(self) -> MessagesRequest:
        if self.container is not None:
            raise UnsupportedParameter("container", "containers (code execution) are not supported")
        return self

    def budget_problem(self, *, interleaved: bool) -> str | None:
        """Why ``thinking.budget_tokens`` does not fit ``max_tokens`` (Anthropic's rule; a budget past
        ``max_tokens`` is allowed with interleaved thinking, where it spans several turns), or None."""
        thinking = self.thinking
        if thinking is None or thinking.budget_tokens is None or interleaved:
            return None
        if thinking.budget_tokens >= self.max_tokens:
            return f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens ({self.max_tokens})"
        return None


# ---- content blocks ------------------------------------------------------------------------------------------


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ParameterError(where, "a message must be an object")
    role = message.get("role")
    if role not in ROLES:
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
        blocks = [_block(block, f"{where}.content[{j}]", role) for j, block in enumerate(content)]
    else:
        raise ParameterError(f"{where}.content", "expected a string or a list of content blocks")
    return {"role": role, "content": blocks}


def _block(block: Any, where: str, role: str) -> dict[str, Any]:
    """A content block in its canonical shape, or a ``ParameterError`` naming what is wrong with it."""
    if not isinstance(block, dict):
        raise ParameterError(where, "a content block must be an object")
    kind = block.get("type")
    if kind in UNSUPPORTED_BLOCKS:
        raise UnsupportedParameter(f"{where}.type", UNSUPPORTED_BLOCKS[kind])
    if kind not in BLOCKS_BY_ROLE[role]:
        allowed = ", ".join(sorted(BLOCKS_BY_ROLE[role]))
        raise ParameterError(f"{where}.type", f"a {role} message takes blocks of type {allowed}, not {shown(kind)}")
    extra = sorted(set(block) - BLOCK_FIELDS[kind])
    if extra:
        raise ParameterError(f"{where}.{extra[0]}", f"unknown field in a {kind} block")
    if kind == "text":
        return {"type": "text", "text": _string(block, "text", where)}
    if kind == "thinking":
        return {
            "type": "thinking",
            "thinking": _string(block, "thinking", where),
            "signature": _string(block, "signature", where),
        }
    if kind == "redacted_thinking":
        return {"type": "redacted_thinking", "data": _string(block, "data", where)}
    if kind == "tool_use":
        use_id = _string(block, "id", where)
        if not TOOL_USE_ID.fullmatch(use_id):
            raise ParameterError(f"{where}.id", "a tool_use id is letters, digits, underscores and dashes")
        if not isinstance(block.get("input"), dict):
            raise ParameterError(f"{where}.input", "expected an object")
        caller = block.get("caller")
        if caller is not None and caller != {"type": "direct"}:
            raise UnsupportedParameter(f"{where}.caller", "only direct tool calls are supported")
        return {"type": "tool_use", "id": use_id, "name": _string(block, "name", where), "input": block["input"]}
    # tool_result
    content = block.get("content", "")
    references: list[str] = []  # tools a tool search loaded (``tool_reference`` blocks)
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            here = f"{where}.content[{k}]"
            if not isinstance(part, dict):
                raise ParameterError(here, "a content block must be an object")
            kind = part.get("type")
            if kind in UNSUPPORTED_BLOCKS:
                raise UnsupportedParameter(f"{here}.type", UNSUPPORTED_BLOCKS[kind])
            if kind == "tool_reference":
                extra = sorted(set(part) - {"type", "tool_name", "cache_control"})
                if extra:
                    raise ParameterError(f"{here}.{extra[0]}", "unknown field in a tool_reference block")
                references.append(_string(part, "tool_name", here))
                texts.append(f"Tool loaded: {part['tool_name']}")
                continue
            if kind != "text":
                raise ParameterError(f"{here}.type", f"expected 'text' or 'tool_reference', got {shown(kind)}")
            texts.append(_block(part, here, "user")["text"])
        content = "\n\n".join(texts)
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


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if value is None and key not in block:
        raise MissingParameter(f"{where}.{key}", f"a {block.get('type')} block needs {key}")
    if not isinstance(value, str):
        raise ParameterError(f"{where}.{key}", "expected a string")
    return value


def _custom_tool(tool: Any, where: str) -> None:
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


def _check_tool_turns(messages: list[dict[str, Any]]) -> None:
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

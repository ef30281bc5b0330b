"""The Messages API request bodies (``POST /v1/messages`` and ``/v1/messages/count_tokens``), validated once.

Content blocks and tools are checked by hand in ``gateway.anthropic.blocks``, not as nested pydantic models.
Errors name the full path (``messages[2].content[0].type``), as on the OpenAI routes.

What Anthropic would refuse is refused (a final assistant message, as on models without prefill; a
``tool_result`` that answers no ``tool_use`` of the turn before; thinking with a forced tool; ``budget_tokens``
under 1024); fields of Anthropic's service that change nothing here are accepted and ignored (``cache_control``,
``metadata`` beyond ``user_id``, ``service_tier``, ``inference_geo``, ``diagnostics``); features this gateway
cannot honour are a 400 that names them (images and documents, server tools, MCP servers, containers,
``clear_tool_uses`` context edits, ``speed: "fast"``). Deferred tools (``defer_loading``) stay out of the prompt until a
``tool_reference`` in a tool result loads them, as Anthropic's tool search does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from gateway.anthropic.blocks import canonical_block, canonical_message, check_custom_tool, check_tool_turns
from gateway.openai.parameters import (
    MAX_TOKENS_LIMIT,
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
        if self.type == "enabled":  # without budget_tokens too, as DeepSeek's Anthropic-format API takes it
            if self.budget_tokens is not None and self.budget_tokens < MIN_THINKING_BUDGET:
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
        return [canonical_message(message, f"[{i}]") for i, message in enumerate(value)]

    @field_validator("system")
    @classmethod
    def _system_text(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            return [canonical_block(block, f"[{i}]", "system") for i, block in enumerate(value)]
        return value

    @field_validator("tools")
    @classmethod
    def _custom_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        names: set[str] = set()
        for i, tool in enumerate(value or ()):
            check_custom_tool(tool, f"[{i}]")
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
        check_tool_turns(self.messages)
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


ConversationRequest = CountTokensRequest | MessagesRequest
"""The body of either Messages route: what translating a conversation reads (sampling only from a MessagesRequest)."""

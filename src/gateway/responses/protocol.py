"""The Responses API request (``POST /v1/responses``) and its translation into chat messages.

A Responses request is a chat request in other clothes: its input items (messages, reasoning, function calls
and their outputs) become chat messages, its function tools and ``text.format`` the chat ``tools`` and
``response_format``. Items are first brought into one canonical shape, with ids: the shape they are stored in
and listed by ``GET /v1/responses/{id}/input_items``.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from backends.interface import SamplingOptions
from gateway.openai.parameters import MAX_TOKENS_LIMIT, UnsupportedParameter, WholeInt
from gateway.openai.tools import RESPONSES_TOOLS, check_function_tools, check_tool_choice, tool_choice_problem

SUPPORTED_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")
"""``include`` values accepted. Reasoning is returned in plain text (``content``), never encrypted, so
``reasoning.encrypted_content`` adds nothing; it is accepted because stateless clients always ask for it."""
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "summary_text": "text"}
IMAGE_DETAILS = ("low", "high", "auto")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Body(BaseModel):
    """Strict, as the chat and completion bodies are: a string is never read as a number or a boolean, nor a boolean
    as a number (``invalid_type``); a whole-number float is an integer (``WholeInt``)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Body):
    """``text.format``: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_rules(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a 'name' and a 'schema'")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat ``response_format`` for it (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name, "schema": self.json_schema}
        if self.strict is not None:
            spec["strict"] = self.strict
        if self.description is not None:
            spec["description"] = self.description
        return {"type": "json_schema", "json_schema": spec}

    def echo(self) -> dict[str, Any]:
        """As the response reports it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: StrictStr | StrictInt | None = Field(
        None, description="none, minimal, low, medium, high, xhigh, or (extension) an integer from 1 to 100"
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted; the model's reasoning is returned in full as reasoning content, not summarized"
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Body):
    include_obfuscation: bool | None = None


class CreateResponseRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: WholeInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(None, description="default true: keep the response for previous_response_id and GET")
    previous_response_id: str | None = Field(None, min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512, description="the end user's id; at most 512 characters, as DeepSeek")
    truncation: Literal["disabled", "auto"] | None = None
    seed: WholeInt | None = Field(None, ge=-(2**63), lt=2**64, description="extension: reproducible sampling")
    top_k: WholeInt | None = Field(None, ge=-1, description="extension: sample among the k most likely tokens")
    ignore_eos: bool = Field(False, description="extension: generate until max_output_tokens even past end-of-sequence")
    service_tier: Literal["auto", "default", "flex", "priority", "fast", "scale"] | None = Field(
        None,
        description="auto (or none): the API key's default tier; fast: priority, as OpenAI serves it; a tier the "
        "key may not use (scale, which this gateway does not have, included): its default",
    )
    # Accepted at their defaults only (see the validator).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: WholeInt | None = Field(None, ge=1)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    context_management: list[dict[str, Any]] | None = None

    @field_validator("input")
    @classmethod
    def _canonical_items(cls, value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(value, str):
            return [_message_item(None, "user", [{"type": "input_text", "text": value}], None)]
        if not value:
            raise UnsupportedParameter("", "the input list is empty")
        return [canonical_item(item, f"[{i}]") for i, item in enumerate(value)]

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        check_function_tools(value, RESPONSES_TOOLS)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        check_tool_choice(value, RESPONSES_TOOLS)
        return value

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value: list[str] | None) -> list[str] | None:
        for i, name in enumerate(value or ()):
            if name not in SUPPORTED_INCLUDES:
                raise UnsupportedParameter(f"[{i}]", f"{name!r} is not supported here")
        return value

    @model_validator(mode="after")
    def _responses_rules(self) -> CreateResponseRequest:
        if self.background:
            raise UnsupportedParameter("background", "background responses are not supported")
        if self.conversation is not None:
            raise UnsupportedParameter("conversation", "conversations are not supported; use previous_response_id")
        if self.prompt is not None:
            raise UnsupportedParameter("prompt", "stored prompt templates are not supported")
        if self.truncation == "auto":
            raise UnsupportedParameter("truncation", "only 'disabled' is supported")
        if self.context_management:
            raise UnsupportedParameter("context_management", "context management is not supported")
        if self.max_tool_calls is not None:
            raise UnsupportedParameter("max_tool_calls", "max_tool_calls is not supported")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise UnsupportedParameter("text.verbosity", "only 'medium' is supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options needs stream: true")
        return self

    # The chat request it stands for.
    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as canonical items (the validator has converted it)."""
        assert isinstance(self.input, list)
        return self.input

    def tool_choice_problem(self) -> str | None:
        """Why ``tool_choice`` does not fit ``tools`` (the 400 chat gives for it), or None."""
        return tool_choice_problem(self.tool_choice, self.tools, RESPONSES_TOOLS)

    def stores(self) -> bool:
        return self.store is not False

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=self.wants_logprobs(),
            top_logprobs=(self.top_logprobs or 0) if self.wants_logprobs() else 0,
        )

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for tool in self.tools:
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    def response_format(self) -> dict[str, Any] | None:
        if self.text is None or self.text.format is None:
            return None
        return self.text.format.response_format()

    def reasoning_effort(self) -> str | int | None:
        return self.reasoning.effort if self.reasoning is not None else None


def _message_item(item_id: str | None, role: str, content: list[dict[str, Any]], status: str | None) -> dict[str, Any]:
    return {
        "id": item_id if isinstance(item_id, str) and item_id else new_id("msg"),
        "type": "message",
        "role": role,
        "status": status or "completed",
        "content": content,
    }


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part, by URL (a data URL; whether the model takes images is the backend's to say)."""
    if part.get("file_id") is not None:
        raise UnsupportedParameter(f"{where}.file_id", "images by file_id are not supported; send image_url")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise UnsupportedParameter(f"{where}.image_url", "an input_image part needs image_url (a data URL)")
    detail = part.get("detail", "auto")
    if detail not in IMAGE_DETAILS:
        raise UnsupportedParameter(f"{where}.detail", "expected 'low', 'high' or 'auto'")
    extra = sorted(set(part) - {"type", "image_url", "detail", "file_id"})
    if extra:
        raise UnsupportedParameter(f"{where}.{extra[0]}", "unknown field in an input_image part")
    return {"type": "input_image", "image_url": url, "detail": detail}


def _text(part: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise UnsupportedParameter(where, "a content part must be an object")
    kind = part.get("type")
    if kind == "input_image" and "input_image" in allowed:
        return _image(part, where)
    if kind not in allowed:
        raise UnsupportedParameter(f"{where}.type", f"content parts of type {kind!r} are not supported here")
    key = TEXT_PARTS[kind]
    if not isinstance(part.get(key), str):
        raise UnsupportedParameter(f"{where}.{key}", "must be a string")
    if kind == "output_text":
        return {"type": "output_text", "text": part["text"], "annotations": [], "logprobs": []}
    return {"type": kind, key: part[key]}


def canonical_item(item: Any, where: str) -> dict[str, Any]:
    """One input item in its stored shape, or ``UnsupportedParameter`` naming the offending field."""
    if not isinstance(item, dict):
        raise UnsupportedParameter(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        return _message_input(item, where)
    if kind == "function_call":
        return _function_call_input(item, where)
    if kind == "function_call_output":
        return _function_call_output_input(item, where)
    if kind == "reasoning":
        return _reasoning_input(item, where)
    raise UnsupportedParameter(f"{where}.type", f"input items of type {kind!r} are not supported")


def _message_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A message item: its role, and its content as parts of the types that role may send."""
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise UnsupportedParameter(f"{where}.role", f"expected one of {', '.join(MESSAGE_ROLES)}")
    content = item.get("content")
    if role == "assistant":
        allowed: tuple[str, ...] = ("output_text", "refusal", "input_text")
    elif role == "user":
        allowed = ("input_text", "input_image")
    else:
        allowed = ("input_text",)
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise UnsupportedParameter(f"{where}.content", "must be a string or a list of content parts")
    canonical = [_text(part, f"{where}.content[{j}]", allowed) for j, part in enumerate(parts)]
    if role == "assistant":  # stored as the output message it was
        canonical = [
            p if p["type"] != "input_text" else {**p, "type": "output_text", "annotations": [], "logprobs": []}
            for p in canonical
        ]
    return _message_item(item.get("id"), role, canonical, item.get("status"))


def _function_call_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function call the model made earlier: string call id, name and arguments."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise UnsupportedParameter(f"{where}.{key}", "must be a string")
    return {
        "id": item.get("id") or new_id("fc"),
        "type": "function_call",
        "call_id": item["call_id"],
        "name": item["name"],
        "arguments": item["arguments"],
        "status": item.get("status") or "completed",
    }


def _function_call_output_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function call's result, its output a string or text parts joined into one."""
    if not isinstance(item.get("call_id"), str):
        raise UnsupportedParameter(f"{where}.call_id", "must be a string")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text(p, f"{where}.output[{j}]", ("input_text",))["text"] for j, p in enumerate(output))
    if not isinstance(output, str):
        raise UnsupportedParameter(f"{where}.output", "must be a string or a list of input_text parts")
    return {
        "id": item.get("id") or new_id("fco"),
        "type": "function_call_output",
        "call_id": item["call_id"],
        "output": output,
        "status": item.get("status") or "completed",
    }


def _reasoning_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A reasoning item from an earlier turn: lists of summary and reasoning text parts."""
    summary = item.get("summary") or []
    content = item.get("content") or []
    if not isinstance(summary, list) or not isinstance(content, list):
        raise UnsupportedParameter(f"{where}.summary", "summary and content must be lists of text parts")
    return {
        "id": item.get("id") or new_id("rs"),
        "type": "reasoning",
        "summary": [_text(p, f"{where}.summary[{j}]", ("summary_text",)) for j, p in enumerate(summary)],
        "content": [_reasoning_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)],
    }


def _reasoning_part(part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
        raise UnsupportedParameter(where, 'expected {"type": "reasoning_text", "text": ...}')
    return {"type": "reasoning_text", "text": part["text"]}


def _joined(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in parts)


def _message_content(parts: list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """A message's chat content: its text, or with images, chat parts (each image part naming its input part)."""
    if not any(p["type"] == "input_image" for p in parts):
        return _joined(parts)
    return [
        {
            "type": "image_url",
            "image_url": {"url": p["image_url"], "detail": p["detail"]},
            "path": f"{where}.content[{j}]",
        }
        if p["type"] == "input_image"
        else {"type": "text", "text": p.get("text") or ""}
        for j, p in enumerate(parts)
    ]


def unmatched_call_output(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(position in ``items``, call id) of the first function_call_output no earlier function_call asked for."""
    calls = {item["call_id"] for item in history if item["type"] == "function_call"}
    for position, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            return position, item["call_id"]
    return None


CHAT_PARAMS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def responses_param(param: str) -> str:
    """A chat request's parameter path (as a backend names it in an error) in Responses terms."""
    for chat, responses in CHAT_PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            rest = param[len(chat) :]
            return "input" if chat == "messages" else responses + rest
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def responses_message(message: str) -> str:
    """A backend's error message with chat parameter names in Responses terms."""
    for chat, responses in CHAT_PARAMS[:-1]:
        message = message.replace(chat, responses)
    return message


def chat_messages(instructions: str | None, items: list[dict[str, Any]], first_input: int = 0) -> list[dict[str, Any]]:
    """The chat messages for canonical items. An assistant turn's reasoning, text and function calls arrive as
    separate items; consecutive ones fold into one assistant message, as the model wrote them. ``items[first_input]``
    is ``input[0]`` (those before it come from ``previous_response_id``), which names an image in an error."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def close_turn() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for position, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning" or (kind == "message" and item["role"] == "assistant"):
            if turn is not None and (turn["content"] or "tool_calls" in turn):
                close_turn()  # a new assistant turn begins
            if turn is None:
                turn = {"role": "assistant", "content": ""}
            if kind == "reasoning":
                text = _joined(item["content"]) if item["content"] else _joined(item["summary"])
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
            else:
                turn["content"] += _joined(item["content"])
        elif kind == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": ""}
            function = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": function})
        else:
            close_turn()
            if kind == "message":
                where = f"input[{position - first_input}]" if position >= first_input else "previous_response_id"
                messages.append({"role": item["role"], "content": _message_content(item["content"], where)})
            else:  # function_call_output
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    close_turn()
    return messages

"""A Messages request as the gateway's chat ``GenerateRequest``: the same request every backend already serves.

- ``system`` and role-``system`` messages become system messages; a user turn becomes its ``tool`` messages (one
  per ``tool_result``, in order) followed by a user message with its text; an assistant turn (consecutive
  assistant messages are one) becomes one assistant message with its text, its thinking as
  ``reasoning_content`` (checked against its signature) and its ``tool_use`` blocks as ``tool_calls``.
- ``tools`` become function tools (``input_schema`` is the function's ``parameters``; a deferred tool only once a
  ``tool_reference`` loaded it); ``tool_choice`` ``auto``,
  ``any``, ``tool`` and ``none`` become ``auto``, ``required``, a named function and ``none``, and
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
- ``thinking`` (``enabled``, ``adaptive``, ``between_tools``) is V4.1's thinking mode, ``disabled`` its chat mode;
  ``output_config.effort`` is the request's ``reasoning_effort`` (the backend's effort table applies) in thinking
  mode. Without ``thinking``, the backend's default mode.
- ``output_config.format`` is a ``json_schema`` response format; ``stop_sequences``, ``temperature``, ``top_p``,
  ``top_k`` and ``metadata.user_id`` are the chat request's sampling and ``user``.
"""

from __future__ import annotations

import json
from typing import Any

from backends.interface import GenerateRequest, SamplingOptions
from gateway.anthropic.protocol import ConversationRequest, MessagesRequest
from gateway.anthropic.signatures import ThinkingSigner
from gateway.errors import APIError

ERROR_RESULT_PREFIX = "Error: "
"""A ``tool_result`` with ``is_error`` reaches the model as its text after this prefix (V4.1's tool results have
no error flag)."""


def chat_messages(body: ConversationRequest, signer: ThinkingSigner) -> list[dict[str, Any]]:
    """The chat messages of a Messages request; a thinking block whose signature is not this gateway's is a 400."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    for i, message in enumerate(body.messages):
        role = message["role"]
        if role != "assistant" and turn is not None:
            messages.append(turn)
            turn = None
        if role == "assistant":
            if turn is None:
                turn = {"role": "assistant", "content": ""}
            _add_assistant_blocks(turn, message["content"], i, signer)
        elif role == "system":
            messages.append({"role": "system", "content": _text(message["content"])})
        else:
            _add_user_blocks(messages, message["content"], i)
    if turn is not None:
        messages.append(turn)
    kept = body.context_management.thinking_turns_kept() if body.context_management is not None else None
    if kept is not None:
        _clear_thinking(messages, kept)
    return messages


def _add_user_blocks(messages: list[dict[str, Any]], blocks: list[dict[str, Any]], index: int) -> None:
    """A user message's blocks: tool results as tool messages, then its text and images as one user message (an
    image part names its block, ``messages[i].content[j]``, for errors)."""
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if block["type"] == "tool_result":
            content = block["content"]
            if block["is_error"]:
                content = ERROR_RESULT_PREFIX + content
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        elif block["type"] == "image":
            url = {"url": block["url"]}
            parts.append({"type": "image_url", "image_url": url, "path": f"messages[{index}].content[{j}]"})
        else:
            parts.append({"type": "text", "text": block["text"]})
    if len(parts) == 1 and parts[0]["type"] == "text":
        messages.append({"role": "user", "content": parts[0]["text"]})
    elif parts:
        messages.append({"role": "user", "content": parts})


def _add_assistant_blocks(
    turn: dict[str, Any], blocks: list[dict[str, Any]], index: int, signer: ThinkingSigner
) -> None:
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            turn["content"] += block["text"]
        elif kind == "thinking":
            reasoning = signer.verify(block["thinking"], block["signature"])
            if reasoning is None:
                where = f"messages[{index}].content[{j}].signature"
                raise APIError(
                    400,
                    f"Invalid 'signature' in 'thinking' block ({where}): thinking blocks must be sent back as this "
                    "gateway returned them.",
                    param=where,
                )
            turn["reasoning_content"] = turn.get("reasoning_content", "") + reasoning
        elif kind == "tool_use":
            function = {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}
            turn.setdefault("tool_calls", []).append({"id": block["id"], "type": "function", "function": function})
        # redacted_thinking: opaque data another server encrypted; there is nothing in it to show the model


def _clear_thinking(messages: list[dict[str, Any]], kept: int) -> None:
    """``clear_thinking_20251015``: only the latest ``kept`` assistant turns keep their thinking."""
    turns = [m for m in messages if m["role"] == "assistant"]
    for message in turns[: max(0, len(turns) - kept)]:
        message.pop("reasoning_content", None)


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "\n\n".join(block["text"] for block in content)


def chat_tools(body: ConversationRequest) -> list[dict[str, Any]] | None:
    """The function tools the model is told about: every tool but a deferred one (``defer_loading``) that no
    ``tool_reference`` of a tool result has loaded yet."""
    if not body.tools:
        return None
    loaded = {name for m in body.messages for block in m["content"] for name in block.get("references", ())}
    out = []
    for tool in body.tools:
        if tool.get("defer_loading") and tool["name"] not in loaded:
            continue
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(body: ConversationRequest) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(``tool_choice``, ``parallel_tool_calls``) of the chat request."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def thinking_mode(body: ConversationRequest) -> tuple[bool | None, str | None]:
    """(``thinking``, ``reasoning_effort``) of the chat request: the effort only counts in thinking mode."""
    thinking = body.thinking
    if thinking is None:
        return None, None
    if not thinking.on:
        return False, None
    effort = body.output_config.effort if body.output_config is not None else None
    return True, effort


def response_format(body: ConversationRequest) -> dict[str, Any] | None:
    output = body.output_config
    if output is None or output.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output.format.json_schema}}


def sampling_options(body: MessagesRequest) -> SamplingOptions:
    top_p = body.top_p
    return SamplingOptions(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=None if top_p == 0 else top_p,
        top_k=1 if top_p == 0 else (body.top_k or None),  # nucleus of mass 0: the most likely token alone
        stop=list(body.stop_sequences or ()),
        fit_context=True,  # prompt + max_tokens past the context: output up to its end (docs/anthropic.md)
    )


def generate_request(
    body: ConversationRequest, *, request_id: str, model: str, signer: ThinkingSigner, max_buffered_tokens: int | None
) -> GenerateRequest:
    """The chat request a Messages request (or a token count, which has no sampling) stands for."""
    thinking, effort = thinking_mode(body)
    tool_choice, parallel = chat_tool_choice(body)
    sampling, user = SamplingOptions(), None
    if isinstance(body, MessagesRequest):
        sampling = sampling_options(body)
        user = body.metadata.user_id if body.metadata is not None else None
    return GenerateRequest(
        request_id=request_id,
        model=model,
        messages=chat_messages(body, signer),
        sampling=sampling,
        max_buffered_tokens=max_buffered_tokens,
        user=user,
        tools=chat_tools(body),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=response_format(body),
        thinking=thinking,
        reasoning_effort=effort,
    )


CHAT_TERMS = (
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("reasoning_effort", "output_config.effort"),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    (".function.parameters", ".input_schema"),
    ("chat_template_kwargs", "thinking"),
)
"""Chat parameter names a backend's error may use, and what the Messages request calls them."""


def messages_terms(message: str) -> str:
    """A backend's error message with chat parameter names in Messages terms."""
    for chat, messages in CHAT_TERMS:
        message = message.replace(chat, messages)
    return message

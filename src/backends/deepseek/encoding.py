"""Renders OpenAI-shaped chat messages into the DeepSeek V4.1 prompt string the model was trained on.

The rules follow DeepSeek's V4.1 reference encoder as described in
``shared/reference/deepseek-v41-format.md`` (sections H1-H6), plus the vLLM wrapper's input handling
(role check, ``reasoning`` alias, list-content flattening, where ``tools`` go). The output is plain text
meant to be tokenized with ``add_special_tokens=False``: BOS is part of the string.

Pipeline of :func:`encode_messages`:

1. normalize and validate the caller's dicts into private records (the caller's data is never mutated);
2. attach ``tools`` and ``response_format`` to the first system message (inserting an empty one at 0);
3. merge ``tool`` messages and following ``user`` messages into single user turns, tool results sorted
   by the order of the preceding assistant's tool calls;
4. in thinking mode with ``drop_thinking`` (disabled when tools are present), drop reasoning and
   developer messages that come before the last user turn;
5. render each turn, then the transition that opens the next assistant turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from backends.deepseek.effort import effort_value

# --- Special strings (H1) -------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

THINK_START = "<think>"
THINK_END = "</think>"

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

# Internal task tokens of the reference encoder. The gateway never emits them; they are listed so that
# every special string of the format has one home.
TASK_ACTION = "<｜action｜>"
TASK_QUERY = "<｜query｜>"
TASK_AUTHORITY = "<｜authority｜>"
TASK_DOMAIN = "<｜domain｜>"
TASK_TITLE = "<｜title｜>"
TASK_READ_URL = "<｜read_url｜>"
TASK_TOKENS = (TASK_ACTION, TASK_QUERY, TASK_AUTHORITY, TASK_DOMAIN, TASK_TITLE, TASK_READ_URL)

DSML = "｜DSML｜"
DSML_CALLS_START = f"<{DSML} calls>"
DSML_CALLS_END = f"</{DSML} calls>"
DSML_INVOKE_START = f'<{DSML} invoke name="'  # followed by NAME and '">'
DSML_INVOKE_END = f"</{DSML} invoke>"
DSML_PARAMETER_START = f'<{DSML} parameter name="'  # followed by KEY, '" string="true|false">' and VALUE
DSML_PARAMETER_END = f"</{DSML} parameter>"

TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

# --- Reasoning effort (H3) ------------------------------------------------------------------------------

EFFORT_PREFIX_TEMPLATE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
"""Printed at the top of a thinking-mode prompt; the number comes from ``effort.effort_value`` (released table)."""


# --- Fixed prompt sections (H3, H5) ---------------------------------------------------------------------

TOOLS_BLOCK_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    f'You can invoke tools by writing a "{DSML_CALLS_START}" block like the following:\n\n'
    + "\n".join(
        (
            DSML_CALLS_START,
            f'{DSML_INVOKE_START}$TOOL_NAME">',
            f'{DSML_PARAMETER_START}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{DSML_PARAMETER_END}',
            "...",
            DSML_INVOKE_END,
            f'{DSML_INVOKE_START}$TOOL_NAME2">',
            "...",
            DSML_INVOKE_END,
            DSML_CALLS_END,
        )
    )
    + '\n\nString parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
    'and set `string="false"`.'
    "\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response."
    "\n\nOtherwise, output directly after </think> with tool calls or final response."
    "\n\n### Available Tool Schemas\n\n"
)
"""Everything of the tools block that precedes the per-tool JSON schema lines."""

TOOLS_BLOCK_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

# --- Roles ----------------------------------------------------------------------------------------------

ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
"""``latest_reminder`` is an encoder-level role for the gateway's own use; clients may send the other five."""

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil"})

# Roles that survive unchanged before the last user turn when thinking is dropped (H2.6). Assistants
# survive without their reasoning; developer messages are dropped.
_KEPT_BEFORE_LAST_USER = frozenset({"user", "system", "tool", "latest_reminder", "direct_search_results"})


@dataclass(frozen=True)
class ToolCall:
    """An assistant tool call with its arguments already decoded into a dict."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class _Block:
    """One piece of a user turn: plain text, or the result of one tool call."""

    kind: str  # "text" | "tool_result"
    text: str
    tool_use_id: str = ""


@dataclass(frozen=True)
class _Turn:
    """A validated message, detached from the caller's dict."""

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    blocks: tuple[_Block, ...] = ()
    tools: tuple[Mapping[str, Any], ...] = ()
    response_format: Mapping[str, Any] | None = None


# --- Public API -----------------------------------------------------------------------------------------


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | int | None = None,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render a chat request as a DeepSeek V4.1 prompt string.

    ``tools`` (the OpenAI tools list) go on the first system message, as vLLM's wrapper does; an empty
    system message is inserted at index 0 when there is none. ``response_format`` is put on the same
    message in the same way. That second part is the gateway's choice: vLLM's wrapper never injects
    ``response_format``, but the V4.1 encoder renders it when a system message carries it. A
    ``{"type": "text"}`` response format means "no constraint" and is not rendered.

    ``reasoning_effort`` is validated and printed only in thinking mode; chat mode ignores it.

    Raises ``ValueError`` for an unknown role, a developer message without content, an unsupported
    content part, a malformed tool call or tool, an invalid effort (thinking mode), an empty message list,
    or ``continue_final_message`` without a final assistant message.
    """
    turns = _normalize_messages(messages)

    if continue_final_message:
        if turns[-1].role != "assistant":
            raise ValueError("continue_final_message requires the last message to have role 'assistant'")
        add_generation_prompt = False

    effort_prefix = EFFORT_PREFIX_TEMPLATE.format(effort_value(reasoning_effort)) if thinking else ""

    tool_specs = _normalize_tools(tools)
    if response_format is not None and not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object")
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    turns = _attach_to_first_system(turns, tool_specs, response_format)

    turns = _merge_user_turns(turns)

    if any(turn.tools for turn in turns):
        drop_thinking = False
    if thinking and drop_thinking:
        turns = _drop_history_thinking(turns)

    last_user_idx = _last_user_index(turns)
    last_idx = len(turns) - 1
    parts: list[str] = [BOS] if add_bos else []
    for idx, turn in enumerate(turns):
        if idx == 0 and (effort_prefix or turn.role == "system"):
            parts.append(SYSTEM + effort_prefix)
        parts.append(
            _render_turn(
                idx,
                turn,
                thinking=thinking,
                drop_thinking=drop_thinking,
                last_user_idx=last_user_idx,
                continued=continue_final_message and idx == last_idx,
            )
        )
        parts.append(
            _transition(
                idx,
                turns,
                thinking=thinking,
                drop_thinking=drop_thinking,
                last_user_idx=last_user_idx,
                add_generation_prompt=add_generation_prompt,
            )
        )
    return "".join(parts)


def prompt_ends_in_thinking(prompt: str) -> bool:
    """Tell whether generation starts inside reasoning, to pick the output parser's initial state.

    True when the last assistant header opened ``<think>`` and nothing after it closed the reasoning:
    a fresh thinking-mode prompt (``…<｜Assistant｜><think>``), a continued final message whose reasoning
    has no ``</think>`` yet, or a latest reminder placed right after ``<think>``.
    """
    head = prompt.rfind(ASSISTANT)
    if head < 0:
        return False
    tail = prompt[head + len(ASSISTANT) :]
    return tail.startswith(THINK_START) and THINK_END not in tail and EOS not in tail


def render_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    """Render assistant tool calls as the DSML block V4.1 emits (empty string when there are none)."""
    if not tool_calls:
        return ""
    invokes = []
    for call in tool_calls:
        params = "\n".join(_render_parameter(key, value) for key, value in call.arguments.items())
        invokes.append(f'{DSML_INVOKE_START}{call.name}">\n{params}\n{DSML_INVOKE_END}')
    return "\n\n" + DSML_CALLS_START + "\n" + "\n".join(invokes) + "\n" + DSML_CALLS_END


def render_tools_block(functions: Sequence[Mapping[str, Any]]) -> str:
    """Render the ``## Tools`` section for the given function schemas (the OpenAI wrapper already removed)."""
    schemas = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in functions)
    return TOOLS_BLOCK_HEADER + schemas + TOOLS_BLOCK_FOOTER


def decode_tool_arguments(arguments: Any) -> dict[str, Any]:
    """Turn OpenAI tool-call arguments into the dict rendered as DSML parameters.

    A dict is used as is; a string is JSON-decoded up to twice (clients sometimes double-encode). Anything
    that does not end up as a dict, including a string that is not valid JSON, becomes
    ``{"arguments": <the value as given>}``.
    """
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            break
    if isinstance(value, Mapping):
        return dict(value)
    return {"arguments": arguments}


# --- Normalization (H6) ---------------------------------------------------------------------------------


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[_Turn]:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(idx, msg) for idx, msg in enumerate(messages)]


def _normalize_message(idx: int, msg: Mapping[str, Any]) -> _Turn:
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
        return _Turn(role=role, content=content, reasoning=reasoning, tool_calls=calls)

    if role == "tool":
        call_id = msg.get("tool_call_id")
        if "content" in msg and msg["content"] is None:
            content = "None"  # DeepSeek's encoder prints a null tool result as Python does
        return _Turn(role=role, content=content, tool_call_id="" if call_id is None else str(call_id))

    return _Turn(role=role, content=content)


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


def _normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> tuple[Mapping[str, Any], ...]:
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


# --- Conversation rewrites (H2, H5) ---------------------------------------------------------------------


def _attach_to_first_system(
    turns: list[_Turn],
    tools: tuple[Mapping[str, Any], ...],
    response_format: Mapping[str, Any] | None,
) -> list[_Turn]:
    if not tools and response_format is None:
        return turns
    turns = list(turns)
    target = next((i for i, turn in enumerate(turns) if turn.role == "system"), None)
    if target is None:
        turns.insert(0, _Turn(role="system"))
        target = 0
    turns[target] = replace(turns[target], tools=tools, response_format=response_format)
    return turns


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Fold each run of consecutive tool and user messages into one user turn made of blocks (H2.2, H2.3)."""
    merged: list[_Turn] = []
    last_calls: tuple[ToolCall, ...] = ()
    for turn in turns:
        if turn.role == "tool":
            block = _Block("tool_result", turn.content, turn.tool_call_id)
        elif turn.role == "user":
            block = _Block("text", turn.content)
        else:
            if merged and merged[-1].role == "user":
                merged[-1] = _sort_tool_results(merged[-1], last_calls)
            if turn.role == "assistant" and turn.tool_calls:  # results after a call-less reply keep the last order
                last_calls = turn.tool_calls
            merged.append(turn)
            continue
        if merged and merged[-1].role == "user":
            merged[-1] = replace(merged[-1], blocks=(*merged[-1].blocks, block))
        else:
            merged.append(_Turn(role="user", blocks=(block,)))
    if merged and merged[-1].role == "user":
        merged[-1] = _sort_tool_results(merged[-1], last_calls)
    return merged


def _sort_tool_results(turn: _Turn, calls: tuple[ToolCall, ...]) -> _Turn:
    """Order tool results by their call's position in the preceding assistant turn; text keeps its slots."""
    order = {call.id: position for position, call in enumerate(calls) if call.id}  # a repeated id: its last call
    slots = [i for i, block in enumerate(turn.blocks) if block.kind == "tool_result"]
    if len(slots) < 2 or not order:
        return turn
    results = sorted((turn.blocks[i] for i in slots), key=lambda block: order.get(block.tool_use_id, 0))
    blocks = list(turn.blocks)
    for slot, block in zip(slots, results, strict=True):
        blocks[slot] = block
    return replace(turn, blocks=tuple(blocks))


def _last_user_index(turns: Sequence[_Turn]) -> int:
    """Index of the last user/developer turn or mid-conversation system message, -1 when there is none.

    A user turn made only of tool results does not count: it continues the assistant's turn rather than
    starting a new one (DeepSeek's released encoder), so the reasoning of the calls it answers is kept.
    """
    for idx in range(len(turns) - 1, -1, -1):
        turn = turns[idx]
        if turn.role == "user" and turn.blocks and all(block.kind == "tool_result" for block in turn.blocks):
            continue
        if turn.role in ("user", "developer") or (turn.role == "system" and idx > 0):
            return idx
    return -1


def _drop_history_thinking(turns: list[_Turn]) -> list[_Turn]:
    """Remove reasoning and developer messages that precede the last user turn (H2.6)."""
    last_user_idx = _last_user_index(turns)
    kept: list[_Turn] = []
    for idx, turn in enumerate(turns):
        if idx >= last_user_idx or turn.role in _KEPT_BEFORE_LAST_USER:
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=None))
        # developer messages before the last user turn are dropped
    return kept


# --- Rendering (H3, H4) ---------------------------------------------------------------------------------


def _render_turn(
    idx: int,
    turn: _Turn,
    *,
    thinking: bool,
    drop_thinking: bool,
    last_user_idx: int,
    continued: bool,
) -> str:
    role = turn.role
    if role == "system":
        head = SYSTEM if idx > 0 else ""  # index 0 gets its tag from the effort rule
        return head + turn.content + _system_suffixes(turn)
    if role == "developer":
        return USER + turn.content + _system_suffixes(turn)
    if role == "user":
        return USER + "\n\n".join(_render_block(block) for block in turn.blocks)
    if role == "latest_reminder":
        return LATEST_REMINDER + turn.content
    if role == "assistant":
        thinking_part = ""
        if thinking:
            if continued and turn.reasoning and not turn.content and not turn.tool_calls:
                thinking_part = turn.reasoning  # no </think>: the model keeps reasoning
            elif not drop_thinking or idx > last_user_idx:
                thinking_part = (turn.reasoning or "") + THINK_END
        end = "" if continued else EOS
        return thinking_part + turn.content + render_tool_calls(turn.tool_calls) + end
    raise AssertionError(f"unexpected role {role!r} after normalization")


def _system_suffixes(turn: _Turn) -> str:
    out = ""
    if turn.tools:
        out += "\n\n" + render_tools_block(turn.tools)
    if turn.response_format is not None:
        out += "\n\n" + RESPONSE_FORMAT_HEADER + json.dumps(turn.response_format, ensure_ascii=False)
    return out


def _render_block(block: _Block) -> str:
    if block.kind == "tool_result":
        return TOOL_RESULT_START + block.text + TOOL_RESULT_END
    return block.text


def _render_parameter(key: str, value: Any) -> str:
    if isinstance(value, str):
        is_string, text = "true", value
    else:
        is_string, text = "false", json.dumps(value, ensure_ascii=False)
    return f'{DSML_PARAMETER_START}{key}" string="{is_string}">{text}{DSML_PARAMETER_END}'


def _transition(
    idx: int,
    turns: Sequence[_Turn],
    *,
    thinking: bool,
    drop_thinking: bool,
    last_user_idx: int,
    add_generation_prompt: bool,
) -> str:
    """What follows a turn: the next assistant header and its thinking tag, or nothing (H4)."""
    is_last = idx == len(turns) - 1
    if is_last and not add_generation_prompt:
        return ""
    if not is_last and turns[idx + 1].role not in ("assistant", "latest_reminder"):
        return ""
    role = turns[idx].role
    opens_assistant = (
        role in ("user", "developer") or (role == "system" and idx > 0) or (is_last and role in ("system", "assistant"))
    )
    if not opens_assistant:
        return ""
    think = thinking and (not drop_thinking or idx >= last_user_idx)
    return ASSISTANT + (THINK_START if think else THINK_END)

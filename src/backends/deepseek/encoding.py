"""Renders OpenAI-shaped chat messages into the DeepSeek V4.1 prompt string the model was trained on.

The rules follow DeepSeek's V4.1 reference encoder as described in
``shared/reference/deepseek-v41-format.md`` (sections H1-H6), plus the vLLM wrapper's input handling
(role check, ``reasoning`` alias, list-content flattening, where ``tools`` go). The output is plain text
meant to be tokenized with ``add_special_tokens=False``: BOS is part of the string.

Pipeline of :func:`encode_messages`:

1. normalize and validate the caller's dicts into records (``messages``; the caller's data is never mutated);
2. attach ``tools`` and ``response_format`` to the first system message (inserting an empty one at 0;
   steps 2-4 are ``conversation``);
3. merge ``tool`` messages and following ``user`` messages into single user turns, tool results sorted
   by the order of the preceding assistant's tool calls;
4. in thinking mode with ``drop_thinking`` (disabled when tools are present), drop reasoning and
   developer messages that come before the last user turn;
5. render each turn, then the transition that opens the next assistant turn (tool calls and the tools block
   in DSML: ``dsml``; the special strings: ``markers``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from backends.deepseek.conversation import (
    attach_to_first_system,
    drop_history_thinking,
    last_user_index,
    merge_user_turns,
)
from backends.deepseek.dsml import render_tool_calls, render_tools_block
from backends.deepseek.effort import effort_value
from backends.deepseek.markers import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    SYSTEM,
    THINK_END,
    THINK_START,
    TOOL_RESULT_END,
    TOOL_RESULT_START,
    USER,
)
from backends.deepseek.messages import Block, Turn, normalize_messages, normalize_tools

# --- Fixed prompt sections (H3, H5) ---------------------------------------------------------------------

EFFORT_PREFIX_TEMPLATE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
"""Printed at the top of a thinking-mode prompt; the number comes from ``effort.effort_value`` (released table)."""

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

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
    turns = normalize_messages(messages)

    if continue_final_message:
        if turns[-1].role != "assistant":
            raise ValueError("continue_final_message requires the last message to have role 'assistant'")
        add_generation_prompt = False

    effort_prefix = EFFORT_PREFIX_TEMPLATE.format(effort_value(reasoning_effort)) if thinking else ""

    tool_specs = normalize_tools(tools)
    if response_format is not None and not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object")
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    turns = attach_to_first_system(turns, tool_specs, response_format)

    turns = merge_user_turns(turns)

    if any(turn.tools for turn in turns):
        drop_thinking = False
    if thinking and drop_thinking:
        turns = drop_history_thinking(turns)

    last_user_idx = last_user_index(turns)
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


# --- Rendering (H3, H4) ---------------------------------------------------------------------------------


def _render_turn(
    idx: int,
    turn: Turn,
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


def _system_suffixes(turn: Turn) -> str:
    out = ""
    if turn.tools:
        out += "\n\n" + render_tools_block(turn.tools)
    if turn.response_format is not None:
        out += "\n\n" + RESPONSE_FORMAT_HEADER + json.dumps(turn.response_format, ensure_ascii=False)
    return out


def _render_block(block: Block) -> str:
    if block.kind == "tool_result":
        return TOOL_RESULT_START + block.text + TOOL_RESULT_END
    return block.text


def _transition(
    idx: int,
    turns: Sequence[Turn],
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

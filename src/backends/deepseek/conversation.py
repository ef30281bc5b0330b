"""The conversation rewrites of the V4.1 encoder (H2, H5): where tools go, merged user turns, dropped reasoning."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from backends.deepseek.dsml import ToolCall
from backends.deepseek.messages import Block, Turn

# Roles that survive unchanged before the last user turn when thinking is dropped (H2.6). Assistants
# survive without their reasoning; developer messages are dropped.
_KEPT_BEFORE_LAST_USER = frozenset({"user", "system", "tool", "latest_reminder", "direct_search_results"})


def attach_to_first_system(
    turns: list[Turn],
    tools: tuple[Mapping[str, Any], ...],
    response_format: Mapping[str, Any] | None,
) -> list[Turn]:
    """Put ``tools`` and ``response_format`` on the first system message, inserting an empty one at 0 (H5)."""
    if not tools and response_format is None:
        return turns
    turns = list(turns)
    target = next((i for i, turn in enumerate(turns) if turn.role == "system"), None)
    if target is None:
        turns.insert(0, Turn(role="system"))
        target = 0
    turns[target] = replace(turns[target], tools=tools, response_format=response_format)
    return turns


def merge_user_turns(turns: list[Turn]) -> list[Turn]:
    """Fold each run of consecutive tool and user messages into one user turn made of blocks (H2.2, H2.3)."""
    merged: list[Turn] = []
    last_calls: tuple[ToolCall, ...] = ()
    for turn in turns:
        if turn.role == "tool":
            block = Block("tool_result", turn.content, turn.tool_call_id)
        elif turn.role == "user":
            block = Block("text", turn.content)
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
            merged.append(Turn(role="user", blocks=(block,)))
    if merged and merged[-1].role == "user":
        merged[-1] = _sort_tool_results(merged[-1], last_calls)
    return merged


def _sort_tool_results(turn: Turn, calls: tuple[ToolCall, ...]) -> Turn:
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


def last_user_index(turns: Sequence[Turn]) -> int:
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


def drop_history_thinking(turns: list[Turn]) -> list[Turn]:
    """Remove reasoning and developer messages that precede the last user turn (H2.6)."""
    last_user_idx = last_user_index(turns)
    kept: list[Turn] = []
    for idx, turn in enumerate(turns):
        if idx >= last_user_idx or turn.role in _KEPT_BEFORE_LAST_USER:
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=None))
        # developer messages before the last user turn are dropped
    return kept

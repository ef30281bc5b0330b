"""Model output with DSML tool calls, as deepseek-recipe's V4.1 encoding writes them: the text the parser and the
forced-call grammars must read. The library renders a historical assistant turn with the calls; the block is cut
out of that prompt, so the markup is DeepSeek's, not a copy of it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as recipe

CALLS_START = "\n\n<｜DSML｜ calls>"
CALLS_END = "</｜DSML｜ calls>"


@dataclass(frozen=True)
class ToolCall:
    """A tool call with its arguments as a dict."""

    id: str
    name: str
    arguments: dict[str, Any]


def render_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    """The DSML block V4.1 emits for these calls, from its leading blank line to the closing tag ("" for none)."""
    if not tool_calls:
        return ""
    calls = [recipe.ToolCall(call.id, call.name, json.dumps(call.arguments, ensure_ascii=False)) for call in tool_calls]
    conversation = recipe.Conversation(
        [recipe.UserMessage("q"), recipe.AssistantMessage("", None, calls)], thinking_mode=False
    )
    prompt = recipe.DeepseekV41Encoding().render_conversation(conversation).prompt
    start = prompt.index(CALLS_START)
    return prompt[start : prompt.index(CALLS_END, start) + len(CALLS_END)]

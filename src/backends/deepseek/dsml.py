"""DSML, V4.1's tool-call markup: the ``## Tools`` prompt section and assistant tool calls rendered as DSML."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.deepseek.markers import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    DSML_PARAMETER_END,
    DSML_PARAMETER_START,
)

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


@dataclass(frozen=True)
class ToolCall:
    """An assistant tool call with its arguments already decoded into a dict."""

    id: str
    name: str
    arguments: dict[str, Any]


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


def _render_parameter(key: str, value: Any) -> str:
    if isinstance(value, str):
        is_string, text = "true", value
    else:
        is_string, text = "false", json.dumps(value, ensure_ascii=False)
    return f'{DSML_PARAMETER_START}{key}" string="{is_string}">{text}{DSML_PARAMETER_END}'

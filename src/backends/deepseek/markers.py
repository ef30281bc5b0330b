"""The special strings of DeepSeek V4.1's chat format (H1 of ``shared/reference/deepseek-v41-format.md``).

The encoder writes them, the output parser and the forced-call grammars read them: one home for all of them.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

THINK_START = "<think>"
THINK_END = "</think>"

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

DSML = "｜DSML｜"
DSML_CALLS_START = f"<{DSML} calls>"
DSML_CALLS_END = f"</{DSML} calls>"
DSML_INVOKE_START = f'<{DSML} invoke name="'  # followed by NAME and '">'
DSML_INVOKE_END = f"</{DSML} invoke>"
DSML_PARAMETER_START = f'<{DSML} parameter name="'  # followed by KEY, '" string="true|false">' and VALUE
DSML_PARAMETER_END = f"</{DSML} parameter>"

TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

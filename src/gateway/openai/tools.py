"""Function tools and ``tool_choice`` as the chat and Responses APIs declare them: one validator for both APIs.

The two APIs spell a function tool differently (chat nests its name and parameters under ``function``, the
Responses API puts them on the tool itself) and define different other tool types, but what makes a function
tool valid is the same: an invalid or repeated name or a ``parameters`` that is not an object is an
``invalid_value`` naming the full path (``tools[0].function.name``, ``tools[0].name``); a tool type the API
defines and this gateway cannot serve is an ``unsupported_value``; any other type is an ``invalid_value``. The same
goes for ``tool_choice``, and a choice that does not fit the tools is the same 400 in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.openai.parameters import TOOL_NAME, ParameterError, UnsupportedParameter, shown


@dataclass(frozen=True, slots=True)
class ToolLayout:
    """How one API spells its tools."""

    function_key: str | None
    """The key that holds a function tool's name and parameters (chat: ``function``); None when they sit on the
    tool itself (Responses)."""
    unsupported_types: frozenset[str]
    """Tool types the API defines that this gateway cannot serve."""
    unsupported_choice_types: frozenset[str]
    """``tool_choice`` types the API defines that this gateway cannot serve."""

    def function(self, declared: dict[str, Any]) -> Any:
        """The object holding a validated tool's or ``tool_choice``'s function name."""
        return declared[self.function_key] if self.function_key is not None else declared


TOOL_CHOICE_MODES = ("none", "auto", "required")
CHAT_TOOLS = ToolLayout("function", frozenset({"custom"}), frozenset({"allowed_tools", "custom"}))
_RESPONSES_BUILTINS = frozenset(
    {
        "custom",
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
    }
)
RESPONSES_TOOLS = ToolLayout(None, _RESPONSES_BUILTINS, _RESPONSES_BUILTINS | {"allowed_tools"})


def check_function_tools(tools: list[dict[str, Any]] | None, layout: ToolLayout) -> None:
    """Raises a ``ParameterError`` (its ``where`` below ``tools``) for the first tool that is not a valid function
    tool, or a repeated name."""
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str) and kind in layout.unsupported_types:
                raise UnsupportedParameter(
                    f"[{i}].type", f"tools of type {shown(kind)} are not supported; use function tools"
                )
            raise ParameterError(f"[{i}].type", f"expected 'function', got {shown(kind)}")
        where = f"[{i}]"
        function: Any = tool
        if layout.function_key is not None:
            where = f"[{i}].{layout.function_key}"
            function = tool.get(layout.function_key)
            if not isinstance(function, dict):
                raise ParameterError(where, "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ParameterError(f"{where}.name", "must be 1-64 letters, digits, underscores or dashes")
        if name in names:
            raise ParameterError(f"{where}.name", f"the function {shown(name)} is given twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ParameterError(f"{where}.parameters", "must be a JSON Schema object")


def check_tool_choice(choice: str | dict[str, Any] | None, layout: ToolLayout) -> None:
    """Raises a ``ParameterError`` (its ``where`` below ``tool_choice``) for a choice of the wrong shape."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ParameterError("", "expected 'none', 'auto', 'required' or a function object")
        return
    if choice is None:
        return
    kind = choice.get("type")
    if isinstance(kind, str) and kind in layout.unsupported_choice_types:
        raise UnsupportedParameter(".type", f"tool_choice of type {shown(kind)} is not supported")
    if kind != "function":
        raise ParameterError(".type", f"expected 'function', got {shown(kind)}")
    where = ""
    function: Any = choice
    if layout.function_key is not None:
        where = f".{layout.function_key}"
        function = choice.get(layout.function_key)
        if not isinstance(function, dict):
            raise ParameterError(where, 'expected {"name": ...}')
    if not isinstance(function.get("name"), str):
        raise ParameterError(f"{where}.name", "expected a string")


def tool_choice_problem(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None, layout: ToolLayout
) -> str | None:
    """Why a validated ``tool_choice`` does not fit the validated ``tools`` (OpenAI answers these with a 400 on
    ``tool_choice``), or None."""
    if choice in (None, "none", "auto"):
        return None
    if not tools:
        return "tool_choice 'required' or a named function needs tools"
    if isinstance(choice, dict):
        name = layout.function(choice)["name"]
        if all(layout.function(tool)["name"] != name for tool in tools):
            return f"tool_choice names the function {shown(name)}, which is not in tools"
    return None

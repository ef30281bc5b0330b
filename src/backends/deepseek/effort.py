"""DeepSeek V4.1's reasoning effort: the released table, and how the efforts of the APIs we serve map onto it.

V4.1 reads its effort as a number on a 1-100 scale printed at the top of a thinking-mode prompt
(``Reasoning Effort: N``). DeepSeek's released encoder names four levels; every front end (OpenAI's
``reasoning_effort``, the Responses API's ``reasoning.effort``, or any other API's thinking settings) maps its own
words onto those levels here, so the table lives in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

V41_EFFORTS: Mapping[str, int] = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
"""The named efforts of DeepSeek's released V4.1 encoder and the number each prints (``xhigh`` prints the same 75
as ``high``). Any integer from 1 to 100 is accepted as well."""

DEFAULT_V41_EFFORT = "high"
"""What V4.1's encoder uses when a thinking-mode request names no effort (75)."""

OPENAI_EFFORTS: Mapping[str, str | None] = {
    "none": None,
    "minimal": None,
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
"""OpenAI ``reasoning_effort`` -> V4.1 effort; None means chat mode (no reasoning). ``medium`` is OpenAI's default
and V4.1 has no such level: it maps to V4.1's own default, ``high``."""


def is_effort_number(value: Any) -> TypeGuard[int]:
    """An integer effort V4.1 accepts as is (1-100; a bool is not a number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100


def effort_value(effort: str | int | None) -> int:
    """The number printed for a V4.1 effort (a name of ``V41_EFFORTS``, an integer 1-100, or None: the default).

    Raises ``ValueError`` naming the accepted values for anything else (V4.1's encoder asserts on it).
    """
    if effort is None:
        return V41_EFFORTS[DEFAULT_V41_EFFORT]
    if is_effort_number(effort):
        return effort
    if isinstance(effort, str) and effort in V41_EFFORTS:
        return V41_EFFORTS[effort]
    raise ValueError(
        f"invalid reasoning_effort {effort!r}: expected one of {', '.join(repr(name) for name in V41_EFFORTS)} "
        "or an integer from 1 to 100"
    )


def v41_effort(effort: Any) -> str | int | None:
    """Map an OpenAI ``reasoning_effort`` (or an integer 1-100) to V4.1's; None for ``none``/``minimal`` and unset.

    Raises ``ValueError`` naming the accepted values for anything else.
    """
    if effort is None:
        return None
    if is_effort_number(effort):
        return effort
    if isinstance(effort, str) and effort in OPENAI_EFFORTS:
        return OPENAI_EFFORTS[effort]
    raise ValueError(
        f"invalid reasoning_effort {effort!r}: expected one of {', '.join(OPENAI_EFFORTS)} or an integer from 1 to 100"
    )

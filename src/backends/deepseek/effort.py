"""Reasoning effort for DeepSeek V4.1: DeepSeek's names and mapping, and the gateway's integer extension.

deepseek-recipe renders the named efforts (``low`` 50, ``high`` 75, ``xhigh`` 75, ``max`` 100 printed as
``Reasoning Effort: N``); DeepSeek's API maps the effort words of the APIs it serves onto them (api-docs.deepseek.com:
minimal/low -> low, medium/high/xhigh -> high, max/ultra -> max; ``none`` turns thinking off). ``xhigh`` is kept
as the library's own ``xhigh`` (its converter does the same), which prints the same 75 as ``high``. An integer from
1 to 100 is this gateway's extension: the library's model has no such effort, so the number is printed in place of
``high``'s (``prompt_encoding``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from backends.deepseek.conversation import LibraryEffort

EFFORTS: Mapping[str, LibraryEffort | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
    "ultra": "max",
}
"""An API's effort word -> the library's effort; None means thinking off."""

DEFAULT_EFFORT: LibraryEffort = "high"
"""The effort of a thinking-mode request that names none (DeepSeek's default, and the library's)."""


def is_effort_number(value: Any) -> TypeGuard[int]:
    """An integer effort (1-100; a bool is not a number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100


def parse_effort(effort: Any) -> tuple[bool, LibraryEffort | int | None]:
    """(whether the effort turns thinking off, the library's effort or an integer); (False, None) when unset.

    Raises ``ValueError`` naming the accepted values for anything else.
    """
    if effort is None:
        return False, None
    if is_effort_number(effort):
        return False, effort
    if isinstance(effort, str) and effort in EFFORTS:
        named = EFFORTS[effort]
        return named is None, named
    raise ValueError(
        f"invalid reasoning_effort {effort!r}: expected one of {', '.join(EFFORTS)} or an integer from 1 to 100"
    )

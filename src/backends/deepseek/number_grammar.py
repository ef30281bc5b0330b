"""Numeric sub-grammars of the schema compiler: GBNF for the integers and decimals within a schema's bounds.

Bounds are ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (drafts 4 and 6+); a bounded
number is written without an exponent, with at most 16 decimals, and bounds of at most ``MAX_BOUND_DIGITS`` digits
are compiled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from backends.deepseek.gbnf import alternatives, literal, text_literal

MAX_BOUND_DIGITS = 20
"""Numeric bounds up to 10**20 (every 64-bit integer) are compiled; a larger one is refused, as its digit-by-digit
rules would grow with it (and a bound near 10**1500 is no bound a tool means)."""

_BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def integer_value(schema: Mapping[str, Any]) -> str:
    """GBNF for an ``integer`` schema: any JSON integer, or those within its bounds."""
    low, high = integer_bounds(schema)
    if low is None and high is None:
        return "json-int"
    return integer_range(low, high)


def number_value(schema: Mapping[str, Any]) -> str:
    """GBNF for a ``number`` schema: any JSON number, or those within its bounds (``number_range``)."""
    if not any(k in schema for k in _BOUND_KEYWORDS):
        return "json-number"
    return number_range(schema)


def integer_bounds(schema: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """Inclusive integer bounds from ``minimum`` / ``maximum`` / ``exclusive*`` (drafts 4 and 6+)."""
    low = high = None
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    ex_min, ex_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if _is_number(minimum):
        low = math.floor(minimum) + 1 if ex_min is True and float(minimum).is_integer() else math.ceil(minimum)
    if _is_number(ex_min):
        bound = math.floor(ex_min) + 1
        low = bound if low is None else max(low, bound)
    if _is_number(maximum):
        high = math.ceil(maximum) - 1 if ex_max is True and float(maximum).is_integer() else math.floor(maximum)
    if _is_number(ex_max):
        bound = math.ceil(ex_max) - 1
        high = bound if high is None else min(high, bound)
    return low, high


def _is_number(value: Any) -> TypeGuard[int | float]:
    """A usable bound; raises ``ValueError`` for one too large to compile (``MAX_BOUND_DIGITS``)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if abs(value) >= 10**MAX_BOUND_DIGITS:
        raise ValueError(f"a bound of {MAX_BOUND_DIGITS} digits or more is not supported in a forced tool call")
    return True


def integer_range(low: int | None, high: int | None) -> str:
    """GBNF for the decimal integers in ``[low, high]`` (None: unbounded), without leading zeros or ``-0``."""
    options = _signed_range(low, high)
    if not options:
        raise ValueError(f"no integer lies between {low} and {high}")
    return alternatives(options)


def number_range(schema: Mapping[str, Any]) -> str:
    """GBNF for numbers within a schema's bounds: integers in range, and decimals whose whole part keeps them in.

    A decimal ``k.f`` (``f`` not all zeros) lies strictly between ``k`` and ``k + 1`` (or ``-k - 1`` and
    ``-k``), so it is allowed when that whole open interval is inside the bounds: a slightly smaller set than
    the schema allows near fractional bounds, never a value outside them.
    """
    low, high = _real_bounds(schema)
    options = _signed_range(
        None if low is None else math.ceil(low[0]) + (1 if low[1] and float(low[0]).is_integer() else 0),
        None if high is None else math.floor(high[0]) - (1 if high[1] and float(high[0]).is_integer() else 0),
    )
    fraction = '"." [0-9]{0,15} [1-9]'  # at most 16 decimals: past a double's precision, and a run must end
    # k.f for k >= 0 needs low <= k and k + 1 <= high
    pos_low = 0 if low is None else max(0, math.ceil(low[0]))
    pos_high = None if high is None else math.floor(high[0]) - 1
    if pos_high is None or pos_low <= pos_high:
        options.append(f"{alternatives(_positive_range(pos_low, pos_high))} {fraction}")
    # -k.f for k >= 0 lies in (-k-1, -k): needs -k-1 >= low and -k <= high
    neg_low = 0 if high is None else max(0, math.ceil(-high[0]))
    neg_high = None if low is None else math.floor(-low[0]) - 1
    if neg_high is None or neg_low <= neg_high:
        options.append(f'"-" {alternatives(_positive_range(neg_low, neg_high))} {fraction}')
    if not options:
        raise ValueError("no number lies between the schema's bounds")
    return alternatives(options)


def _real_bounds(schema: Mapping[str, Any]) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """(value, exclusive) lower and upper bounds, the tighter of ``minimum`` and ``exclusiveMinimum`` etc."""
    low: tuple[float, bool] | None = None
    high: tuple[float, bool] | None = None
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    ex_min, ex_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if _is_number(minimum):
        low = (minimum, ex_min is True)
    if _is_number(ex_min) and (low is None or ex_min >= low[0]):
        low = (ex_min, True)
    if _is_number(maximum):
        high = (maximum, ex_max is True)
    if _is_number(ex_max) and (high is None or ex_max <= high[0]):
        high = (ex_max, True)
    return low, high


def _signed_range(low: int | None, high: int | None) -> list[str]:
    options = []
    if low is None or low < 0:  # negatives: -abs with abs in [max(1, -high), -low]
        abs_low = 1 if high is None or high >= 0 else -high
        abs_high = None if low is None else -low
        if abs_high is None or abs_low <= abs_high:
            options.append(f'"-" {alternatives(_positive_range(abs_low, abs_high))}')
    if high is None or high >= 0:
        start = 0 if low is None else max(low, 0)
        if high is None or start <= high:
            options[:0] = _positive_range(start, high)
    return options


def _positive_range(low: int, high: int | None) -> list[str]:
    """Alternatives for the integers in ``[low, high]`` (``0 <= low``; None: no upper bound)."""
    low_text = str(low)
    n = len(low_text)
    if high is None:
        return [*_same_length(low_text, "9" * n), f"[1-9] [0-9]{{{n},}}"]
    high_text = str(high)
    if len(high_text) == n:
        return _same_length(low_text, high_text)
    options = _same_length(low_text, "9" * n)
    for length in range(n + 1, len(high_text)):
        options.append(f"[1-9] [0-9]{{{length - 1}}}")
    options += _same_length("1" + "0" * (len(high_text) - 1), high_text)
    return options


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives for the digit strings from ``low`` to ``high``, both of the same length."""
    if low == high:
        return [text_literal(low)]
    rest = len(low) - 1
    if low == "0" * len(low) and high == "9" * len(high) and rest:
        return [f"[0-9]{{{len(low)}}}"]
    first, last = low[0], high[0]
    if not rest:
        return [f"[{first}-{last}]"]
    if first == last:
        return [f"{literal(first)} {alternatives(_same_length(low[1:], high[1:]))}"]
    options = [f"{literal(first)} {alternatives(_same_length(low[1:], '9' * rest))}"]
    if ord(last) - ord(first) > 1:
        options.append(f"[{chr(ord(first) + 1)}-{chr(ord(last) - 1)}] [0-9]{{{rest}}}")
    options.append(f"{literal(last)} {alternatives(_same_length('0' * rest, high[1:]))}")
    return options

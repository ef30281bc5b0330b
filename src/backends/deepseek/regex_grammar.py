"""A string schema's ``pattern`` (or ``format``) compiled to a GBNF expression, for forced tool calls.

JSON Schema patterns are ECMA-262 regular expressions matched anywhere in the string (unanchored unless they say
``^``/``$``). This module reads them with Python's own regex parser (``re._parser``; the common syntax is shared)
and writes the language they match as GBNF, in one of two spellings of a string value:

- ``json``: the characters as they appear inside a JSON string literal (``"`` and ``\\`` escaped), for values
  written with ``string="false"`` or nested in JSON;
- ``raw``: the characters as they are, for ``string="true"`` values, which may not contain ``<`` (it could open
  ``</｜DSML｜ parameter>``); a pattern that needs a ``<`` has no raw spelling (``None``), and is then written as
  JSON.

ECMA semantics are kept where Python's differ: ``\\d`` is ``[0-9]``, ``\\w`` ``[A-Za-z0-9_]``, ``\\s`` the ASCII
spaces. What cannot be compiled (lookaround, back-references, anchors inside the pattern, case-insensitive flags)
raises ``ValueError`` saying so. Inside character classes, control characters are left out of the JSON spelling
(a subset of the pattern's language, never a superset).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # typeshed describes re's parser under its pre-3.11 names; importing those warns at run time
    import sre_constants as sre
    import sre_parse
else:
    from re import _constants as sre
    from re import _parser as sre_parse

from backends.deepseek.gbnf import alternatives, literal

FORMATS: dict[str, str] = {
    "date": r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
    "time": r"^([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,9})?(Z|z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
    "date-time": (
        r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)"
        r"(\.[0-9]{1,9})?(Z|z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
    ),
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": r"^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$",
    "email": r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}@[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+$",
    "hostname": r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s\"<>\\^`{|}]*$",
}
"""The ``format`` values compiled for forced calls, as the patterns they stand for (RFC 3339 dates and times,
RFC 4122 UUIDs, dotted-quad IPv4, an RFC 5321 address without quoting or IP literals, RFC 1123 host names, an
RFC 3986 URI without spaces). Other formats are not enforced (docs/deepseek.md lists them)."""

_ANCHORS_START = (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING)
_ANCHORS_END = (sre.AT_END, sre.AT_END_STRING)
_MAX_CODEPOINT = 0x10FFFF
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CATEGORIES: dict[Any, tuple[list[tuple[int, int]], bool]] = {
    sre.CATEGORY_DIGIT: (_DIGIT, False),
    sre.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    sre.CATEGORY_WORD: (_WORD, False),
    sre.CATEGORY_NOT_WORD: (_WORD, True),
    sre.CATEGORY_SPACE: (_SPACE, False),
    sre.CATEGORY_NOT_SPACE: (_SPACE, True),
}
_REFUSED_FLAGS = re.IGNORECASE | re.MULTILINE | re.VERBOSE


def pattern_expression(pattern: str, spelling: str) -> str | None:
    """GBNF for the strings ``pattern`` matches (searched, as JSON Schema does), spelled ``json`` or ``raw``.

    None when the raw spelling cannot write them (they need a ``<``). Raises ``ValueError`` for a pattern this
    compiler cannot read.
    """
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} does not compile: {exc}") from None
    if parsed.state.flags & _REFUSED_FLAGS:
        raise ValueError(f"pattern {pattern!r}: inline flags are not supported in a forced call")
    try:
        return _Writer(spelling).top(list(parsed.data))
    except _NoRawSpelling:
        return None
    except _Unsupported as exc:
        raise ValueError(f"pattern {pattern!r}: {exc} is not supported in a forced call") from None


def format_expression(name: str, spelling: str) -> str | None:
    """GBNF for the strings of a supported ``format`` (see ``FORMATS``); KeyError for any other format."""
    return pattern_expression(FORMATS[name], spelling)


def string_shape(schema: Mapping[str, Any], spelling: str) -> str | None:
    """GBNF for the strings a ``pattern`` or supported ``format`` allows, spelled ``json`` or ``raw``; None when
    the schema has neither, or (raw) when they cannot be written raw. Raises ``ValueError`` for a pattern that
    cannot be compiled, and for either one combined with ``minLength`` / ``maxLength`` (no intersection here)."""
    pattern = schema.get("pattern")
    kind = schema.get("format")
    if pattern is None and kind not in FORMATS:
        return None
    if "minLength" in schema or "maxLength" in schema:
        what = "pattern" if pattern is not None else "format"
        raise ValueError(f"{what} together with minLength/maxLength is not supported in a forced tool call")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError("pattern must be a string")
        return pattern_expression(pattern, spelling)
    return format_expression(cast(str, kind), spelling)  # no pattern: ``kind`` is one of FORMATS' names


class _Unsupported(Exception):
    """A regex construct with no GBNF counterpart here."""


class _NoRawSpelling(Exception):
    """The pattern needs a character that raw DSML text cannot hold."""


class _Writer:
    def __init__(self, spelling: str) -> None:
        assert spelling in ("json", "raw")
        self.json = spelling == "json"

    # ---- structure ------------------------------------------------------------------------------------------

    def top(self, items: list[tuple[Any, Any]]) -> str:
        """The whole pattern: anchors at its ends (or at the ends of its top-level branches) bound the match;
        a side without one may have any text there."""
        if len(items) == 1 and items[0][0] is sre.BRANCH:
            return alternatives([self.top(list(branch)) for branch in items[0][1][1]])
        start = bool(items) and items[0][0] is sre.AT and items[0][1] in _ANCHORS_START
        if start:
            items = items[1:]
        end = bool(items) and items[-1][0] is sre.AT and items[-1][1] in _ANCHORS_END
        if end:
            items = items[:-1]
        body = self.sequence(items)
        anything = f"{self.any_char()}*"
        return " ".join(part for part in ("" if start else anything, body, "" if end else anything) if part) or '""'

    def sequence(self, items: list[tuple[Any, Any]]) -> str:
        parts = [self.item(op, arg) for op, arg in items]
        return " ".join(p for p in parts if p) or '""'

    def item(self, op: Any, arg: Any) -> str:
        if op is sre.LITERAL:
            return self.char(arg)
        if op is sre.NOT_LITERAL:
            return self.char_class([(arg, arg)], negated=True)
        if op is sre.ANY:
            return self.char_class([(0x0A, 0x0A)], negated=True)
        if op is sre.IN:
            return self.in_class(arg)
        if op is sre.CATEGORY:
            ranges, negated = _CATEGORIES.get(arg, (None, False))
            if ranges is None:
                raise _Unsupported(f"the class {arg}")
            return self.char_class(ranges, negated)
        if op is sre.BRANCH:
            return alternatives([f"({self.sequence(list(branch))})" for branch in arg[1]])
        if op is sre.SUBPATTERN:
            _group, add_flags, _del_flags, inner = arg
            if add_flags & _REFUSED_FLAGS:
                raise _Unsupported("an inline flag")
            return f"({self.sequence(list(inner))})"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, inner = arg
            body = f"({self.sequence(list(inner))})"
            if high is sre.MAXREPEAT:
                return {0: f"{body}*", 1: f"{body}+"}.get(low, f"{body}{{{low},}}")
            if (low, high) == (0, 1):
                return f"{body}?"
            return '""' if high == 0 else f"{body}{{{low},{high}}}"
        if op is sre.AT:
            raise _Unsupported("an anchor inside the pattern")
        raise _Unsupported(str(op).lower().replace("_", " "))

    # ---- characters -----------------------------------------------------------------------------------------

    def char(self, code: int) -> str:
        ch = chr(code)
        if self.json:
            if ch in '"\\':
                return literal("\\" + ch)
            if code < 0x20:
                return literal(
                    {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}.get(ch, f"\\u{code:04x}")
                )
            return literal(ch)
        if ch == "<":
            raise _NoRawSpelling
        return literal(ch)

    def in_class(self, members: list[tuple[Any, Any]]) -> str:
        negated = bool(members) and members[0][0] is sre.NEGATE
        ranges: list[tuple[int, int]] = []
        for op, arg in members[1:] if negated else members:
            if op is sre.LITERAL:
                ranges.append((arg, arg))
            elif op is sre.RANGE:
                ranges.append(arg)
            elif op is sre.CATEGORY:
                sub, sub_negated = _CATEGORIES.get(arg, (None, False))
                if sub is None or sub_negated:
                    raise _Unsupported(f"the class {arg} inside [...]")
                ranges.extend(sub)
            else:
                raise _Unsupported(f"{op} inside [...]")
        return self.char_class(ranges, negated)

    def char_class(self, ranges: list[tuple[int, int]], negated: bool) -> str:
        """One character of the set (or, ``negated``, of its complement), as the spelling writes it."""
        forbidden = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)] if self.json else [(0x3C, 0x3C)]
        if negated:
            excluded = _merge([*ranges, *forbidden])
            options = ["[^" + _class_body(excluded) + "]"]
            allows = lambda code: not _contains(ranges, code)  # noqa: E731
        else:
            plain = _subtract(_merge(ranges), forbidden)
            options = [f"[{_class_body(plain)}]"] if plain else []
            allows = lambda code: _contains(ranges, code)  # noqa: E731
        if self.json:
            options += [literal("\\" + ch) for ch in '"\\' if allows(ord(ch))]
        if not options:
            if not self.json and allows(0x3C):
                raise _NoRawSpelling
            raise _Unsupported("an empty character class")
        return alternatives(options)

    def any_char(self) -> str:
        return self.char_class([], negated=True)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in _merge(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CODEPOINT:
        out.append((start, _MAX_CODEPOINT))
    return out


def _subtract(ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    keep = _complement(removed)
    out = []
    for low, high in ranges:
        for k_low, k_high in keep:
            a, b = max(low, k_low), min(high, k_high)
            if a <= b:
                out.append((a, b))
    return _merge(out)


def _contains(ranges: list[tuple[int, int]], code: int) -> bool:
    return any(low <= code <= high for low, high in ranges)


def _class_body(ranges: list[tuple[int, int]]) -> str:
    """The inside of a GBNF character class for the given code point ranges, written so that xgrammar and
    llguidance's GBNF reader both read it alike: ``-`` first and unescaped, ``^`` never first, ASCII control
    characters as ``\\xHH`` escapes at the end only (xgrammar reads any hex digits after ``\\x``), every other
    character as itself; surrogates are left out (they are not text)."""
    ranges = _subtract(ranges, [(0xD800, 0xDFFF)])
    dash = _contains(ranges, 0x2D)
    caret = _contains(ranges, 0x5E)
    controls = _merge([(max(a, 0), min(b, 0x1F)) for a, b in ranges if a <= 0x1F])
    if _contains(ranges, 0x7F):
        controls.append((0x7F, 0x7F))
    plain = _subtract(ranges, [(0x00, 0x1F), (0x2D, 0x2D), (0x5E, 0x5E), (0x7F, 0x7F)])
    parts = ["-"] if dash else []
    for low, high in plain:
        parts.append(_class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}")
    if caret:
        parts.append("^" if parts else "\\x5e")
    for low, high in controls:
        parts.append(f"\\x{low:02x}" if low == high else f"\\x{low:02x}-\\x{high:02x}")
    return "".join(parts)


def _class_char(code: int) -> str:
    """A character inside a class other than ``-``, ``^`` and ASCII controls (see ``_class_body``)."""
    ch = chr(code)
    return "\\" + ch if ch in "]\\[" else ch

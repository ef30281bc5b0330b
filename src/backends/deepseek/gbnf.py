"""GBNF building blocks (llama.cpp's dialect, which xgrammar reads and llguidance translates)."""

from __future__ import annotations

import json
from typing import Any


def literal(text: str) -> str:
    """A GBNF string literal for ``text``."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def json_literal(value: Any) -> str:
    """GBNF for exactly ``value`` as JSON, character by character (see ``text_literal``)."""
    return text_literal(json.dumps(value, ensure_ascii=False))


def text_literal(text: str) -> str:
    """GBNF for exactly ``text``, one literal per character.

    The reference engine translates GBNF for a lexer that takes the longest match and does not back off: a
    constant written as one literal would win over a free value that the same text begins (``"a"`` against the
    string ``"ab"``, ``-13`` against the number ``-12``) and cut that alternative off. Single characters are as
    long as the free value's characters, so both stay open.
    """
    return " ".join(literal(ch) for ch in text) if text else '""'


def class_char(ch: str) -> str:
    """``ch`` written inside a GBNF character class."""
    if ch in "]\\^-[":
        return "\\" + ch
    return literal(ch)[1:-1]


def repeat(item: str, low: int, high: int | None) -> str:
    """``item`` repeated ``low`` to ``high`` times (None: no upper bound); ``""`` for none at all."""
    if high == 0:
        return '""'
    return f"{item}{{{low},{'' if high is None else high}}}"


def alternatives(options: list[str]) -> str:
    """``(a | b | c)``, or the single option itself."""
    if len(options) == 1:
        return options[0]
    return "(" + " | ".join(options) + ")"

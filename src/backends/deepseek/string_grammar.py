"""String sub-grammars of the schema compiler: JSON strings shaped by ``pattern`` / ``format`` or bounded in length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.deepseek.gbnf import repeat
from backends.deepseek.regex_grammar import string_shape

JSON_CHAR_THEN = '[^"\\\\\\x00-\\x1f] {next} | "\\\\" (["\\\\/bfnrt] | "u" hex hex hex hex) {next}'
"""One character of a JSON string, then ``next``: ``json-char`` spelled out in each alternative (xgrammar masks the
tokens of a right-recursive string in microseconds only when the character class is not a rule of its own)."""

STRING_CHAIN = 256
"""Strings bounded by ``maxLength`` up to this many characters compile to a chain of one rule per character (fast
masks under xgrammar, as ``json-string-rest``); longer bounds use a plain repeat."""


class StringGrammar:
    """The string values of one compiled schema; each length-chain rule (``{prefix}-s...``) is defined once."""

    def __init__(self, prefix: str, rules: list[str]) -> None:
        self.prefix = prefix
        self.rules = rules
        self._chains: set[str] = set()

    def value(self, schema: Mapping[str, Any]) -> str:
        """A GBNF expression for the JSON strings ``schema`` allows, adding the rules it needs to ``rules``."""
        shaped = string_shape(schema, "json")
        if shaped is not None:
            return f'"\\"" {shaped} "\\""'
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not low and high is None:
            return "json-text"
        if high is not None and high < low:
            raise ValueError("maxLength is below minLength: no string fits")
        return f'"\\"" {self._rest(low, None if high is None else high - low)}'

    def _rest(self, least: int, most: int | None) -> str:
        """The rest of a string, ``least`` characters then at most ``most`` more (None: any), and its closing quote:
        a chain of right-recursive rules (see ``json-string-rest``) up to ``STRING_CHAIN`` characters, a plain
        repeat past it."""
        if least == 0 and most is None:
            return "json-string-rest"
        if least + (most or 0) > STRING_CHAIN:
            return f'{repeat("json-char", least, None if most is None else least + most)} "\\""'
        name = f"{self.prefix}-s{least}-{'' if most is None else most}"
        if name not in self._chains:
            self._chains.add(name)
            if least:
                body = JSON_CHAR_THEN.format(next=self._rest(least - 1, most))
            elif most == 0:
                body = '"\\""'
            else:
                body = '"\\"" | ' + JSON_CHAR_THEN.format(next=self._rest(0, None if most is None else most - 1))
            self.rules.append(f"{name} ::= {body}")
        return name

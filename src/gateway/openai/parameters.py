"""The parameter errors and value types every request body shares (OpenAI's, the Responses API's, Anthropic's).

A validator raises a ``ParameterError`` naming the path below the field it checks; ``gateway.errors`` turns it
into a 400 whose ``param`` is the full path and whose ``code`` says whether the value is invalid, unsupported,
missing or an empty array.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import orjson
from pydantic import BeforeValidator

MAX_TOKENS_LIMIT = 2**31 - 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SHOWN_CHARS = 64
"""Client values quoted in error messages are cut to this many characters."""


def shown(value: object) -> str:
    """A client's value as JSON text for an error message (never a Python repr), cut to ``SHOWN_CHARS``."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = "an array" if isinstance(value, list) else "an object"
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _whole_number(value: Any) -> Any:
    """A float without a fractional part (``16.0``) is the integer it spells: OpenAI's spec is JSON Schema, under
    which 16.0 is an integer, and OpenAI accepts it. Anything else goes on to the strict integer check, so ``16.5``
    is refused with OpenAI's message (an integer expected, a decimal number given), and ``"16"`` or ``true`` too."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


WholeInt = Annotated[int, BeforeValidator(_whole_number)]
"""The type of every integer field: an int, or a float that is a whole number (no other coercion)."""


class ParameterError(ValueError):
    """Raised inside validators. ``where`` is the path below the validated field ("" for the field itself,
    ``[0].type`` below a list, ``top_logprobs`` from a model-level rule), so the 400's ``param`` is the full path."""

    code = "invalid_value"

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.where = where
        self.why = why


class UnsupportedParameter(ParameterError):
    """A valid OpenAI value that this gateway cannot honour: the 400 names the feature."""

    code = "unsupported_value"


class EmptyArray(ParameterError):
    code = "empty_array"


class MissingParameter(ParameterError):
    """A field OpenAI requires in this case (a user message's content, a tool message's tool_call_id)."""

    code = "missing_required_parameter"


def unencodable_text(value: object) -> str | None:
    """The path of the first string (or the object holding the first key) that is not valid Unicode text, such as
    a lone UTF-16 surrogate from a ``\\ud800`` escape; None when all text can be encoded. Iterative, so that a
    deeply nested body cannot exhaust the stack; runs before any tokenizer sees the text."""
    try:
        orjson.dumps(value)  # fails on a lone surrogate (among other things): only then is the body walked
        return None
    except orjson.JSONEncodeError:
        pass
    pending: list[tuple[object, str]] = [(value, "")]
    while pending:
        node, path = pending.pop()
        if isinstance(node, str):
            if not node.isascii() and not _encodable(node):
                return path
        elif isinstance(node, dict):
            children = []
            for key, item in node.items():
                if isinstance(key, str) and not key.isascii() and not _encodable(key):
                    return path
                children.append((item, f"{path}.{key}" if path else str(key)))
            pending.extend(reversed(children))
        elif isinstance(node, list):
            pending.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(node)]))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class InvalidText(ParameterError):
    code = "invalid_value"

    def __init__(self, where: str) -> None:
        super().__init__(where, "the text is not valid Unicode (it holds a lone UTF-16 surrogate)")

"""deepseek-recipe's V4.1 prompt encoding bound to an engine's own tokenizer: a conversation's text and token ids.

The library encodes message text without the tokenizer's added vocabulary, so a client who types
``<｜User｜>`` or ``</think>`` gets those characters as plain text, never the control token; only the markers
the encoding writes itself become special tokens. The engine's tokenizer (DeepInfer's ``tokenizer.json``, or the
reference engine's) is handed to the library as its own ``tokenizer.json`` text, so ids are the engine's.

The one thing encoded here rather than by the library is an integer reasoning effort (the gateway's extension):
the conversation is rendered with ``high``, the printed number replaced, and the text encoded piece by piece
the way the library does it: the spans it reports as special tokens by the full vocabulary, the rest without
the added vocabulary. The suite checks this path against the library's ``encode`` on named efforts.
"""

from __future__ import annotations

import json
import threading

import deepseek_recipe as recipe
from tokenizers import Tokenizer

EFFORT_LINE = "Reasoning Effort: {} ("
"""The start of the effort line the V4.1 encoding prints at the top of a thinking-mode prompt."""
HIGH_EFFORT_NUMBER = 75


class PromptEncoder:
    """The V4.1 encoding of deepseek-recipe with one engine tokenizer; thread-safe (the preparation pool)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        serialized = tokenizer.to_str()
        self._tokenizer = tokenizer
        self._encoding = recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_str(serialized))
        self._plain_json = serialized
        self._plain: Tokenizer | None = None
        self._lock = threading.Lock()

    def render(self, conversation: recipe.Conversation) -> str:
        return self._encoding.render_conversation(conversation).prompt

    def encode(self, conversation: recipe.Conversation, *, effort_number: int | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids); ``effort_number`` prints that integer effort (the conversation says ``high``)."""
        if effort_number is None:
            return self.render(conversation), self._encoding.encode(conversation)
        rendered = self._encoding.render_conversation(conversation)
        text = rendered.prompt
        old, new = EFFORT_LINE.format(HIGH_EFFORT_NUMBER), EFFORT_LINE.format(effort_number)
        at = text.find(old)
        if at < 0:
            raise AssertionError("an integer effort is only printed in thinking mode, which prints the effort line")
        text = text[:at] + new + text[at + len(old) :]
        shift = len(new) - len(old)
        ranges = [
            (start + shift, end + shift) if start > at else (start, end) for start, end in rendered.special_ranges
        ]
        return text, self.encode_pieces(text, ranges)

    def encode_pieces(self, text: str, special_ranges: list[tuple[int, int]]) -> list[int]:
        """Token ids of a rendered prompt: special spans by the full vocabulary, plain text without the added one."""
        plain = self._plain_tokenizer()
        pieces: list[tuple[str, bool]] = []
        position = 0
        for start, end in special_ranges:
            if start > position:
                pieces.append((text[position:start], False))
            pieces.append((text[start:end], True))
            position = end
        if position < len(text):
            pieces.append((text[position:], False))
        ids: list[int] = []
        for piece, special in pieces:
            encoder = self._tokenizer if special else plain
            ids.extend(encoder.encode(piece, add_special_tokens=False).ids)
        return ids

    def _plain_tokenizer(self) -> Tokenizer:
        """The same tokenizer without its added vocabulary (built on first use: only integer efforts need it)."""
        with self._lock:
            if self._plain is None:
                spec = json.loads(self._plain_json)
                spec["added_tokens"] = []
                self._plain = Tokenizer.from_str(json.dumps(spec))
            return self._plain

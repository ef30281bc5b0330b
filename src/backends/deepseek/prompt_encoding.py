"""deepseek-recipe's V4.1 prompt encoding bound to an engine's own tokenizer: a conversation's text and token ids.

The library renders the conversation: its text, and the spans of that text that are control tokens. The ids are
what the library's ``encode`` gives for it, built the way it builds them: each control-token span by the full
vocabulary, and the text between spans without the tokenizer's added vocabulary, so a client who types
``<｜User｜>`` or ``</think>`` gets those characters as plain text, never the control token. The engine's tokenizer
(DeepInfer's ``tokenizer.json``, or the reference engine's) is handed to the library as its own ``tokenizer.json``
text, so ids are the engine's. The suite checks the ids against the library's ``encode`` on generated
conversations.

Encoding the pieces here rather than calling the library's ``encode`` saves what every request would pay again:

- the text the encoding writes around every conversation (the control tokens, the reasoning-effort line of
  thinking mode) is encoded once, when the encoder is built, from the rendering of empty conversations; it holds
  no client text, so it is the same for every tenant and never changes;
- the other pieces are encoded by the library's tokenizer on the calling thread, one call each.

On the reference tokenizer that is 14 µs instead of 37 µs for a short thinking-mode prompt, paid on the event loop
for every short chat request; a long multi-turn chat costs about 5% more than one call for the whole prompt
(docs/bench.md, "Garbage, spinning threads and one write less").

An integer reasoning effort (the gateway's extension) is also encoded here: the conversation is rendered with
``high``, the printed number replaced, and the spans after it shifted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import get_args

import deepseek_recipe as recipe
from tokenizers import Tokenizer  # the engine's (Hugging Face's binding): its JSON is the library's

from backends.deepseek.conversation import LibraryEffort

EFFORT_LINE = "Reasoning Effort: {} ("
"""The start of the effort line the V4.1 encoding prints at the top of a thinking-mode prompt."""
HIGH_EFFORT_NUMBER = 75
LIBRARY_EFFORTS: tuple[LibraryEffort | None, ...] = (None, *get_args(LibraryEffort))

Piece = tuple[str, bool]
"""A span of a rendered prompt, and whether it is a control token (encoded by the full vocabulary)."""


class PromptEncoder:
    """The V4.1 encoding of deepseek-recipe with one engine tokenizer; thread-safe (the preparation pool)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        serialized = tokenizer.to_str()
        self._full = recipe.Tokenizer.from_str(serialized)
        self._encoding = recipe.DeepseekV41Encoding().with_tokenizer(self._full)
        spec = json.loads(serialized)
        spec["added_tokens"] = []
        self._plain = recipe.Tokenizer.from_str(json.dumps(spec))
        """The same tokenizer without its added vocabulary: client text never becomes a control token."""
        self._written: dict[Piece, list[int]] = {}
        """The ids of every piece the encoding writes around an empty conversation, in each mode and effort."""
        for thinking in (False, True):
            for effort in LIBRARY_EFFORTS:
                empty = recipe.Conversation([recipe.UserMessage("")], thinking_mode=thinking, reasoning_effort=effort)
                rendered = self._encoding.render_conversation(empty)
                for piece in pieces_of(rendered.prompt, rendered.special_ranges):
                    self._written[piece] = self._encode_piece(piece)

    def render(self, conversation: recipe.Conversation) -> str:
        return self._encoding.render_conversation(conversation).prompt

    def encode(self, conversation: recipe.Conversation, *, effort_number: int | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids); ``effort_number`` prints that integer effort (the conversation says ``high``)."""
        rendered = self._encoding.render_conversation(conversation)
        text, ranges = rendered.prompt, rendered.special_ranges
        if effort_number is not None:
            text, ranges = _with_effort_number(text, ranges, effort_number)
        return text, self.encode_pieces(text, ranges)

    def encode_pieces(self, text: str, special_ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Token ids of a rendered prompt, the library's: its control-token spans by the full vocabulary, the text
        between without the added one; the pieces the encoding writes are looked up."""
        written = self._written
        ids: list[int] = []
        for piece in pieces_of(text, special_ranges):
            known = written.get(piece)
            ids += self._encode_piece(piece) if known is None else known
        return ids

    def _encode_piece(self, piece: Piece) -> list[int]:
        text, special = piece
        return self._full.encode(text) if special else self._plain.encode(text)


def pieces_of(text: str, special_ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """``text`` cut at its control-token spans (``RenderedPrompt.special_ranges``), in order, empty text left out."""
    pieces: list[Piece] = []
    position = 0
    for start, end in special_ranges:
        if start > position:
            pieces.append((text[position:start], False))
        pieces.append((text[start:end], True))
        position = end
    if position < len(text):
        pieces.append((text[position:], False))
    return pieces


def _with_effort_number(
    text: str, special_ranges: Sequence[tuple[int, int]], number: int
) -> tuple[str, list[tuple[int, int]]]:
    """A thinking-mode prompt rendered with effort ``high``, printing ``number`` instead, and its spans shifted."""
    old, new = EFFORT_LINE.format(HIGH_EFFORT_NUMBER), EFFORT_LINE.format(number)
    at = text.find(old)
    if at < 0:
        raise AssertionError("an integer effort is only printed in thinking mode, which prints the effort line")
    shift = len(new) - len(old)
    ranges = [(start + shift, end + shift) if start > at else (start, end) for start, end in special_ranges]
    return text[:at] + new + text[at + len(old) :], ranges

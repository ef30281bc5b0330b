"""Incremental detokenization: token ids in, text out, never splitting a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from functools import cache

from tokenizers import Tokenizer, decoders


@cache
def byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table that byte-level BPE vocabularies (DeepSeek, Qwen, Llama 3) are
    written in: vocabulary character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTable:
    """Per-id bytes and display strings of a tokenizer's vocabulary, computed once per backend.

    ``bytes_of[i]`` is what token ``i`` contributes to the output text (empty for skipped special tokens);
    ``text_of[i]`` is the token as shown in logprobs. Only byte-level BPE vocabularies (DeepSeek's) get a
    table; others fall back to ``DecodingDetokenizer``.

    ``markers`` are the tags the model family's output parser reads (``<think>``, DSML): a special token whose
    text is part of one of them is kept in the text even when special tokens are skipped, so parsing never
    depends on how a tokenizer flags its markers.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, markers: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(
            i for i, t in added.items() if t.special and not any(t.content in marker for marker in markers)
        )
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        size = max(size, max(added, default=-1) + 1)
        self.bytes_of: list[bytes] = [b""] * size
        self.raw_bytes_of: list[bytes] = [b""] * size
        if self.byte_level:
            alphabet = byte_level_alphabet()
            for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
                self.raw_bytes_of[i] = bytes(alphabet.get(ch, 0) for ch in token)
        else:
            for i in range(size):
                self.raw_bytes_of[i] = tokenizer.decode([i], skip_special_tokens=False).encode()
        for i, t in added.items():
            self.raw_bytes_of[i] = t.content.encode()
        for i, raw in enumerate(self.raw_bytes_of):
            if not (skip_special_tokens and i in self.special_ids):
                self.bytes_of[i] = raw
        self.text_of = [raw.decode("utf-8", "backslashreplace") for raw in self.raw_bytes_of]
        self.skip_special_tokens = skip_special_tokens

    def new_detokenizer(self) -> IncrementalDetokenizer:
        if self.byte_level:
            return ByteLevelDetokenizer(self.bytes_of)
        return DecodingDetokenizer(self.tokenizer, self.special_ids if self.skip_special_tokens else frozenset())


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas."""

    def push(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character becomes U+FFFD)."""
        raise NotImplementedError


class ByteLevelDetokenizer(IncrementalDetokenizer):
    """Exact and O(1) per token: concatenates token bytes and decodes them. Bytes that end mid-character wait in an
    incremental UTF-8 decoder for the next token; while none wait, a step's bytes are decoded in one C call (the
    incremental decoder is Python code; ``bench/output_path.py`` measured 6-16% less Python per stream per step)."""

    __slots__ = ("_bytes_of", "_decoder", "_holding", "_size")

    def __init__(self, bytes_of: list[bytes]) -> None:
        self._bytes_of = bytes_of
        self._size = len(bytes_of)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._holding = False  # whether the decoder holds the start of a character

    def push(self, token_ids: Sequence[int]) -> str:
        table, size = self._bytes_of, self._size
        if len(token_ids) == 1:
            i = token_ids[0]
            data = table[i] if 0 <= i < size else b""
        else:
            data = b"".join([table[i] if 0 <= i < size else b"" for i in token_ids])
        if not self._holding:
            try:
                return data.decode()
            except UnicodeDecodeError:  # a character cut at the end (or broken): the decoder sorts it out
                pass
        text = self._decoder.decode(data)
        self._holding = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        self._holding = False
        return self._decoder.decode(b"", final=True)


class DecodingDetokenizer(IncrementalDetokenizer):
    """For tokenizers without a byte-level vocabulary: decode a short window and emit what is new.

    Text is held back while it ends in U+FFFD, since the next token may complete the character.
    """

    def __init__(self, tokenizer: Tokenizer, skipped: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skipped = skipped
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Sequence[int]) -> str:
        skipped = self._skipped
        self._ids.extend(i for i in token_ids if i not in skipped)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

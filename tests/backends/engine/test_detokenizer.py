"""Incremental detokenization never splits a UTF-8 character and equals a full decode, for any split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from backends.engine.detokenizer import ByteLevelDetokenizer, DecodingDetokenizer, TokenTable
from backends.reference.artifacts import load_or_build


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return TokenTable(load_or_build().tokenizer)


def decode_in_steps(table: TokenTable, ids: list[int], step_sizes: list[int]) -> list[str]:
    detok = table.new_detokenizer()
    pieces, at = [], 0
    for size in step_sizes or [len(ids)]:
        pieces.append(detok.push(ids[at : at + max(size, 1)]))
        at += max(size, 1)
    if at < len(ids):
        pieces.append(detok.push(ids[at:]))
    pieces.append(detok.flush())
    return pieces


def test_reference_tokenizer_gets_the_exact_byte_level_path(table: TokenTable) -> None:
    assert table.byte_level
    assert isinstance(table.new_detokenizer(), ByteLevelDetokenizer)


def test_emoji_split_over_byte_tokens_is_emitted_whole(table: TokenTable) -> None:
    text = "go \U0001f680\U0001f30d now"
    ids = table.tokenizer.encode(text, add_special_tokens=False).ids
    pieces = decode_in_steps(table, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_a_character_cut_short_is_replaced_as_a_full_decode_replaces_it() -> None:
    """Bytes held for a character that never completes become U+FFFD, also when whole characters follow them (the
    fast path that decodes whole characters at once must not run past what the decoder holds)."""
    pieces = [b"\xe2\x82", b"abc", b"\xac", b"d"]  # a Euro sign's first two bytes, cut by "abc"
    detok = ByteLevelDetokenizer(pieces)
    out = [detok.push([i]) for i in range(len(pieces))] + [detok.flush()]
    assert "".join(out) == b"".join(pieces).decode("utf-8", "replace") == "\ufffdabc\ufffdd"
    detok = ByteLevelDetokenizer(pieces)
    assert [detok.push([0]), detok.push([2]), detok.push([1])] == ["", "\u20ac", "abc"]


def test_special_tokens_are_skipped_but_think_tags_are_kept(table: TokenTable) -> None:
    tokenizer = table.tokenizer
    bos, eos = 0, 1
    think = tokenizer.token_to_id("<think>")
    ids = [bos, *tokenizer.encode("hi", add_special_tokens=False).ids, think, eos]
    assert "".join(decode_in_steps(table, ids, [1] * len(ids))) == "hi<think>"


def test_special_tokens_that_are_part_of_a_marker_are_kept() -> None:
    tokenizer = load_or_build().tokenizer
    document = json.loads(tokenizer.to_str())
    for token in document["added_tokens"]:
        token["special"] = token["special"] or token["content"] in ("<think>", "</think>")
    special = Tokenizer.from_str(json.dumps(document))
    ids = [0, *special.encode("a<think>b</think>c", add_special_tokens=False).ids, 1]
    assert "".join(decode_in_steps(TokenTable(special), ids, [1] * len(ids))) == "abc"
    kept = TokenTable(special, markers=("<think>", "</think>"))
    assert "".join(decode_in_steps(kept, ids, [1] * len(ids))) == "a<think>b</think>c"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60), steps=st.lists(st.integers(1, 4), max_size=30))
def test_any_step_split_equals_a_full_decode(table: TokenTable, text: str, steps: list[int]) -> None:
    ids = table.tokenizer.encode(text, add_special_tokens=False).ids
    assert "".join(decode_in_steps(table, ids, steps)) == table.tokenizer.decode(ids)


def test_tokenizers_without_byte_level_vocabulary_use_the_decoding_path() -> None:
    vocab = {"[UNK]": 0, "h": 1, "é": 2, "llo": 3, "▁": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.Metaspace()
    table = TokenTable(tokenizer)
    detok = table.new_detokenizer()
    assert isinstance(detok, DecodingDetokenizer)
    assert detok.push([1]) + detok.push([2, 3]) + detok.flush() == tokenizer.decode([1, 2, 3])

"""The reference tokenizer has DeepSeek's special-token layout and DeepInfer's BOS policy."""

from __future__ import annotations

import pytest

from backends.reference import ReferenceArtifacts
from backends.reference.tokenizer import ASSISTANT, BOS, DSML, EOS, PAD, SYSTEM, THINK, THINK_END, USER


def test_bos_eos_pad_have_ids_0_1_2(artifacts: ReferenceArtifacts) -> None:
    tok = artifacts.tokenizer
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    assert artifacts.special.bos == 0 and artifacts.special.eos == 1 and artifacts.special.pad == 2


def test_encode_empty_string_is_just_bos(artifacts: ReferenceArtifacts) -> None:
    assert artifacts.tokenizer.encode("").ids == [0]


def test_encode_without_special_tokens_adds_nothing(artifacts: ReferenceArtifacts) -> None:
    tok = artifacts.tokenizer
    assert tok.encode("", add_special_tokens=False).ids == []
    assert tok.encode("Hello", add_special_tokens=True).ids == [0, *tok.encode("Hello", add_special_tokens=False).ids]


def test_chat_markers_and_think_tags_are_single_tokens(artifacts: ReferenceArtifacts) -> None:
    tok = artifacts.tokenizer
    sp = artifacts.special
    text = f"{BOS}{SYSTEM}s{USER}Hi{ASSISTANT}{THINK}r{THINK_END}a{EOS}"
    ids = tok.encode(text, add_special_tokens=False).ids
    for marker in (sp.bos, sp.system, sp.user, sp.assistant, sp.think, sp.think_end, sp.eos):
        assert marker in ids
    assert tok.encode(DSML, add_special_tokens=False).ids == [sp.dsml]


@pytest.mark.parametrize(
    "text",
    [
        "plain ASCII, with punctuation!?",
        "日本語のテキストと中文",
        "emoji 🎉 and a family 👩‍👩‍👧 and flags 🇫🇷",
        "tabs\tand\nnewlines\r\n and  double  spaces ",
        "control \x00 \x7f and combining e\u0301",
        '<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>',
    ],
)
def test_utf8_text_round_trips(artifacts: ReferenceArtifacts, text: str) -> None:
    tok = artifacts.tokenizer
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_think_tags_survive_skip_special_tokens_but_role_markers_do_not(artifacts: ReferenceArtifacts) -> None:
    tok = artifacts.tokenizer
    ids = tok.encode(f"{USER}Hi{ASSISTANT}{THINK}why{THINK_END}because{EOS}").ids
    assert tok.decode(ids, skip_special_tokens=True) == f"Hi{THINK}why{THINK_END}because"
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK}why{THINK_END}because{EOS}"

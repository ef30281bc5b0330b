"""Per-choice output processing: which engine outputs become text, logprobs and token counts."""

from __future__ import annotations

import pytest

from backends.engine.backend import _Choice
from backends.engine.detokenizer import TokenTable
from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput
from backends.reference.artifacts import load_or_build


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return TokenTable(load_or_build().tokenizer)


def output(token: int, n: int, finished: bool = False, reason: str = "") -> EngineOutput:
    return EngineOutput("r", token, finished, reason, n, 4, -0.5, [-0.5], [token])


def test_eos_that_finishes_with_stop_is_not_output(table: TokenTable) -> None:
    word = table.tokenizer.encode("hello", add_special_tokens=False).ids[0]
    choice = _Choice(0, table, table.new_detokenizer(), [], logprobs=True)
    delta, finish = choice.consume([output(word, 1), output(EOS_TOKEN_ID, 2, True, "stop")])
    assert finish == "stop"
    assert delta is not None and len(delta.logprobs or []) == 1


def test_eos_sampled_under_ignore_eos_is_an_ordinary_token_with_a_logprob(table: TokenTable) -> None:
    word = table.tokenizer.encode("hello", add_special_tokens=False).ids[0]
    choice = _Choice(0, table, table.new_detokenizer(), [], logprobs=True)
    delta, finish = choice.consume([output(word, 1), output(EOS_TOKEN_ID, 2, True, "length")])
    assert finish == "length"
    assert delta is not None and len(delta.logprobs or []) == 2, "every counted token has a logprob entry"
    assert choice.tokens == 2
    assert delta.text == table.tokenizer.decode([word]), "EOS adds no text"

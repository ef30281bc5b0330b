"""Per-choice output processing: which engine outputs become text, logprobs and token counts."""

from __future__ import annotations

import pytest

from backends.engine.backend import _resolve_max_tokens
from backends.engine.choice import Choice
from backends.engine.detokenizer import TokenTable
from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput
from backends.errors import ContextLengthExceededError
from backends.interface import GenerateRequest, SamplingOptions
from backends.reference.artifacts import load_or_build


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return TokenTable(load_or_build().tokenizer)


def output(token: int, n: int, finished: bool = False, reason: str = "") -> EngineOutput:
    return EngineOutput("r", token, finished, reason, n, 4, -0.5, [-0.5], [token])


def test_eos_that_finishes_with_stop_is_not_output(table: TokenTable) -> None:
    word = table.tokenizer.encode("hello", add_special_tokens=False).ids[0]
    choice = Choice(0, table, table.new_detokenizer(), [], logprobs=True)
    delta, finish = choice.consume([output(word, 1), output(EOS_TOKEN_ID, 2, True, "stop")])
    assert finish == "stop"
    assert delta is not None and len(delta.logprobs or []) == 1


def test_eos_sampled_under_ignore_eos_is_an_ordinary_token_with_a_logprob(table: TokenTable) -> None:
    word = table.tokenizer.encode("hello", add_special_tokens=False).ids[0]
    choice = Choice(0, table, table.new_detokenizer(), [], logprobs=True)
    delta, finish = choice.consume([output(word, 1), output(EOS_TOKEN_ID, 2, True, "length")])
    assert finish == "length"
    assert delta is not None and len(delta.logprobs or []) == 2, "every counted token has a logprob entry"
    assert choice.tokens == 2
    assert delta.text == table.tokenizer.decode([word]), "EOS adds no text"


def test_a_stop_string_ends_the_choice_and_is_named(table: TokenTable) -> None:
    ids = table.tokenizer.encode("hello world again", add_special_tokens=False).ids
    choice = Choice(0, table, table.new_detokenizer(), ["nothing", " world"], logprobs=False)
    delta, finish = choice.consume([output(token, n + 1) for n, token in enumerate(ids)])
    assert finish == "stop" and choice.matched_stop == " world"
    assert delta is not None and delta.text == "hello"


@pytest.mark.parametrize(
    ("asked", "fit", "bound"),
    [(100, True, 100), (5000, True, 4000), (None, False, 4000), (None, True, 4000), (100, False, 100)],
)
def test_max_tokens_is_cut_to_the_context_left_only_when_it_is_just_a_ceiling(
    asked: int | None, fit: bool, bound: int
) -> None:
    request = GenerateRequest("r", "m", prompt="x", sampling=SamplingOptions(max_tokens=asked, fit_context=fit))
    assert _resolve_max_tokens(request, 96, 4096) == bound


def test_max_tokens_past_the_context_is_refused_unless_it_is_just_a_ceiling() -> None:
    request = GenerateRequest("r", "m", prompt="x", sampling=SamplingOptions(max_tokens=5000))
    with pytest.raises(ContextLengthExceededError):
        _resolve_max_tokens(request, 96, 4096)
    request.sampling.fit_context = True
    with pytest.raises(ContextLengthExceededError):  # a prompt that fills the context leaves no room at all
        _resolve_max_tokens(request, 4096, 4096)

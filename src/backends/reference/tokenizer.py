"""A real byte-level BPE tokenizer with DeepSeek's special-token layout, trained on the reference corpus.

DeepInfer pins BOS/EOS/PAD to ids 0/1/2 and prepends BOS on ``encode``; the DeepSeek V4.1 encoder and output
parsers expect the role markers and ``<think>``/``</think>`` to be single tokens. Reproducing that layout on a
small vocabulary lets the whole serving stack run unchanged against the reference engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, LATEST_REMINDER)
"""Special tokens in id order (BOS 0, EOS 1, PAD 2, ...); ``decode(skip_special_tokens=True)`` drops them."""

TEXT_MARKERS: tuple[str, ...] = (THINK, THINK_END, DSML)
"""Single tokens that are part of the text: the reasoning and tool-call parsers must still see them."""

IMAGE = "<｜image｜>"
"""deepseek-recipe's image placeholder. Added when the tokenizer is loaded, after the model's vocabulary (its id is
the model's ``vocab_size``): the model never predicts it, and the engine expands it before the model sees the
prompt (``backends.reference.images``)."""

DEFAULT_VOCAB_SIZE = 8000


class SpecialTokenIds(NamedTuple):
    """Ids of the markers the engine and its training data refer to."""

    bos: int
    eos: int
    pad: int
    system: int
    user: int
    assistant: int
    latest_reminder: int
    think: int
    think_end: int
    dsml: int


def build_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on ``texts``: every UTF-8 string round-trips, emoji and CJK included."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKERS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, 0)],
    )
    check_layout(tokenizer)
    return tokenizer


def check_layout(tokenizer: Tokenizer) -> None:
    """Fail loudly unless the tokenizer passes DeepInfer's release-policy checks."""
    for expected_id, token in enumerate(SPECIAL_TOKENS[:3]):
        if tokenizer.token_to_id(token) != expected_id:
            raise ValueError(f"{token!r} must have id {expected_id}")
    if tokenizer.encode("").ids != [0]:
        raise ValueError('encode("") must be [BOS]')


def special_token_ids(tokenizer: Tokenizer) -> SpecialTokenIds:
    """Look up the marker ids (raises if the tokenizer lacks one)."""
    ids: list[int] = []
    for token in (*SPECIAL_TOKENS, *TEXT_MARKERS):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no token {token!r}")
        ids.append(token_id)
    return SpecialTokenIds(*ids)


def add_image_token(tokenizer: Tokenizer) -> int:
    """Gives the tokenizer the image placeholder as a special token (once); returns its id."""
    existing = tokenizer.token_to_id(IMAGE)
    if existing is not None:
        return existing
    tokenizer.add_special_tokens([AddedToken(IMAGE, special=True, normalized=False)])
    token_id = tokenizer.token_to_id(IMAGE)
    assert token_id is not None
    return token_id

"""The reference engine's language model: an n-gram model over token ids, counted from the corpus.

It is tiny and honest: every next-token distribution is a normalized count over the training sequences, never a
scripted answer. Each context keeps its top ``K`` candidates (ids sorted by descending probability, padded with
distinct ids at probability 0) in dense arrays, so one step of a whole batch is a few numpy gathers.

Contexts are keyed by the last two tokens and a *region*: which part of a DeepSeek chat the text is in, set by
the most recent marker token (``<｜User｜>``/``<｜System｜>``: prompt, ``<think>``: reasoning, ``<｜Assistant｜>`` or
``</think>``: answer; answer when there is no marker). The region is part of the counted context, like a token,
so at a paragraph end a user turn is followed by ``<｜Assistant｜>``, reasoning by ``</think>`` and an answer by
EOS: a thinking-mode prompt yields reasoning, then an answer, then EOS, and a chat answer never emits markers.
Lookup order: trigram (interpolated with the bigram, Witten-Bell) -> bigram -> unigram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

TOP_K = 32
"""Candidates kept per context; also the width of the sampler's rows."""

NO_TOKEN = -1
"""``prev2`` of a context that starts at the first token of a sequence."""

PROMPT, REASONING, ANSWER = 0, 1, 2
NUM_REGIONS = 3
DEFAULT_REGION = ANSWER
"""Text with no marker before it (a plain completion prompt) is continued like an answer."""

MIN_TRIGRAM_COUNT = 2
"""Trigram contexts seen once are left to the bigram: it halves the tables at little cost in fluency."""

SMOOTHING = 0.01
"""Share of every context's probability spread over the whole vocabulary (``background``) when the model scores
text: a real model gives every token a finite logprob, while the top-K tables give 0 to the rest."""

BACKGROUND_FLOOR = 1e-6
"""Least background weight of a token, before normalizing: tokens the tables never propose stay possible."""


@dataclass(frozen=True, slots=True)
class NGramModel:
    """Dense candidate tables; row ``r`` of a table is one context's top-K ids and probabilities.

    Ids are stored as uint16 and probabilities as float16 to halve the tables (about 25 MB); the sampler
    widens and renormalizes the few rows of each step.
    """

    vocab_size: int
    region_of_token: np.ndarray  # int64 [vocab_size]: the region a marker token opens, -1 for other tokens
    bigram_ids: np.ndarray  # uint16 (int32 past 65535) [NUM_REGIONS * vocab_size, K], row = region * V + prev1
    bigram_probs: np.ndarray  # float16 [NUM_REGIONS * vocab_size, K]; rows sum to 1 up to rounding
    trigram_keys: np.ndarray  # int64 [n] sorted, key = (region * vocab_size + prev2) * vocab_size + prev1
    trigram_ids: np.ndarray  # like bigram_ids, [n, K]
    trigram_probs: np.ndarray  # float16 [n, K]
    unigram_ids: np.ndarray  # like bigram_ids, [K]: the row of a context never seen
    unigram_probs: np.ndarray  # float16 [K]

    @property
    def top_k(self) -> int:
        return int(self.bigram_ids.shape[1])

    def region_after(self, tokens: np.ndarray, region: int = DEFAULT_REGION) -> int:
        """The region after ``tokens`` (a prompt), starting from ``region``."""
        opened = self.region_of_token[tokens]
        markers = np.flatnonzero(opened >= 0)
        return int(opened[markers[-1]]) if markers.size else region

    def candidates(self, prev2: np.ndarray, prev1: np.ndarray, region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ids and probabilities ``[batch, K]`` for a batch of contexts (int64 arrays)."""
        v = self.vocab_size
        row2 = region * v + prev1
        ids = self.bigram_ids[row2]
        probs = self.bigram_probs[row2]
        keys = (region * v + prev2) * v + prev1
        if self.trigram_keys.size:
            pos = np.searchsorted(self.trigram_keys, keys)
            np.minimum(pos, self.trigram_keys.size - 1, out=pos)
            found = (self.trigram_keys[pos] == keys) & (prev2 >= 0)
            if found.any():
                hit = np.flatnonzero(found)
                ids[hit] = self.trigram_ids[pos[hit]]
                probs[hit] = self.trigram_probs[pos[hit]]
        return ids, probs

    def background(self) -> np.ndarray:
        """A context-free probability per token (float64 ``[vocab_size]``, every entry > 0, summing to 1).

        The tables keep only each context's top K, so a token's weight is its probability summed over every
        bigram context (how often the model would propose it anywhere), with ``BACKGROUND_FLOOR`` for the
        tokens no context proposes. It smooths scoring (``smoothed``) and ranks tokens where a grammar allows
        none of a context's candidates.
        """
        weights = np.bincount(
            self.bigram_ids.ravel().astype(np.int64),
            weights=self.bigram_probs.ravel().astype(np.float64),
            minlength=self.vocab_size,
        )[: self.vocab_size]
        weights = np.maximum(weights / weights.sum(), BACKGROUND_FLOOR)
        return weights / weights.sum()

    def save(self, path: Path) -> None:
        np.savez(
            path,
            vocab_size=np.int64(self.vocab_size),
            region_of_token=self.region_of_token,
            bigram_ids=self.bigram_ids,
            bigram_probs=self.bigram_probs,
            trigram_keys=self.trigram_keys,
            trigram_ids=self.trigram_ids,
            trigram_probs=self.trigram_probs,
            unigram_ids=self.unigram_ids,
            unigram_probs=self.unigram_probs,
        )

    @classmethod
    def load(cls, path: Path) -> NGramModel:
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
        return cls(vocab_size=int(arrays.pop("vocab_size")), **arrays)


def region_table(vocab_size: int, prompt: Sequence[int], reasoning: Sequence[int], answer: Sequence[int]) -> np.ndarray:
    """Map each marker id to the region it opens (-1 for every other token)."""
    table = np.full(vocab_size, -1, dtype=np.int64)
    for region, markers in ((PROMPT, prompt), (REASONING, reasoning), (ANSWER, answer)):
        table[np.asarray(markers, dtype=np.int64)] = region
    return table


def regions_after(tokens: np.ndarray, starts: np.ndarray, region_of_token: np.ndarray) -> np.ndarray:
    """The region after each token of concatenated sequences (``starts``: index of each sequence's first token)."""
    n = tokens.size
    opened = region_of_token[tokens]
    sequence_start = np.zeros(n, dtype=np.int64)
    sequence_start[starts] = starts
    np.maximum.accumulate(sequence_start, out=sequence_start)
    last_marker = np.where(opened >= 0, np.arange(n), -1)
    np.maximum.accumulate(last_marker, out=last_marker)
    in_sequence = last_marker >= sequence_start
    return np.where(in_sequence, opened[np.maximum(last_marker, 0)], DEFAULT_REGION).astype(np.int64)


def _top_k_rows(
    contexts: np.ndarray, ids: np.ndarray, weights: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge duplicate (context, id) weights, keep each context's top ``k`` ids by weight (ties: lower id).

    Returns the kept entries (context, id, probability renormalized over the kept) and each kept entry's rank.
    """
    span = np.int64(ids.max()) + 1 if ids.size else np.int64(1)
    pair = contexts * span + ids
    unique_pairs, inverse = np.unique(pair, return_inverse=True)
    merged = np.bincount(inverse, weights=weights)
    ctx = unique_pairs // span
    tok = unique_pairs % span
    # Pairs are sorted by (context, id); one stable sort on context + (1 - relative weight) puts each
    # context's ids in descending weight and keeps equal weights in ascending id order.
    peak = np.zeros(int(ctx[-1]) + 1 if ctx.size else 0)
    np.maximum.at(peak, ctx, merged)
    relative = merged / np.maximum(peak[ctx], np.finfo(np.float64).tiny)
    order = np.argsort(2.0 * ctx + (1.0 - relative), kind="stable")
    ctx, tok, merged = ctx[order], tok[order], merged[order]
    first = np.r_[True, ctx[1:] != ctx[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(ctx.size), 0))
    rank = np.arange(ctx.size) - group_start
    keep = rank < k
    ctx, tok, merged, rank = ctx[keep], tok[keep], merged[keep], rank[keep]
    totals = np.bincount(ctx, weights=merged)
    probs = merged / totals[ctx]
    return ctx, tok, probs, rank


def _pad_rows(ids: np.ndarray, probs: np.ndarray, filled: np.ndarray, filler: np.ndarray) -> None:
    """Fill unused slots with distinct ids from ``filler`` (not already in the row), at probability 0."""
    rows = np.flatnonzero(filled < ids.shape[1])
    if rows.size == 0:
        return
    k = ids.shape[1]
    slot = np.arange(k)
    used = np.where(slot[None, :] < filled[rows, None], ids[rows], -1)
    taken = (filler[None, :, None] == used[:, None, :]).any(axis=2)
    free_rank = np.cumsum(~taken, axis=1) - 1
    need = k - filled[rows]
    choose = ~taken & (free_rank < need[:, None])
    row_of, col_of = np.nonzero(choose)
    dest = filled[rows][row_of] + free_rank[row_of, col_of]
    ids[rows[row_of], dest] = filler[col_of]
    probs[rows[row_of], dest] = 0.0


def _dense(
    num_rows: int, ctx: np.ndarray, tok: np.ndarray, probs: np.ndarray, rank: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.zeros((num_rows, k), dtype=np.int32)
    table = np.zeros((num_rows, k), dtype=np.float32)
    ids[ctx, rank] = tok
    table[ctx, rank] = probs
    filled = np.bincount(ctx, minlength=num_rows)
    return ids, table, filled


class _Events(NamedTuple):
    """Training events: predict ``nxt`` from ``(prev2, prev1, region)``, one per token but a sequence's first."""

    nxt: np.ndarray
    prev1: np.ndarray
    prev2: np.ndarray
    region: np.ndarray


def train(
    sequences: Sequence[np.ndarray],
    vocab_size: int,
    region_of_token: np.ndarray,
    k: int = TOP_K,
    min_trigram_count: int = MIN_TRIGRAM_COUNT,
) -> NGramModel:
    """Count the n-grams of ``sequences`` (1-D int token arrays) and build the candidate tables."""
    events = _events(sequences, region_of_token)
    uni_ids, uni_probs, filler = _unigram(events, region_of_token, vocab_size, k)
    bi_ids, bi_probs = _bigram(events, np.int64(vocab_size), uni_ids, uni_probs, filler, k)
    keys, tri_ids, tri_probs = _trigram(events, np.int64(vocab_size), bi_ids, bi_probs, filler, k, min_trigram_count)
    id_type = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    return NGramModel(
        vocab_size=vocab_size,
        region_of_token=region_of_token.astype(np.int64),
        bigram_ids=bi_ids.astype(id_type),
        bigram_probs=bi_probs.astype(np.float16),
        trigram_keys=keys.astype(np.int64),
        trigram_ids=tri_ids.astype(id_type),
        trigram_probs=tri_probs.astype(np.float16),
        unigram_ids=uni_ids.astype(id_type),
        unigram_probs=uni_probs.astype(np.float16),
    )


def _events(sequences: Sequence[np.ndarray], region_of_token: np.ndarray) -> _Events:
    """Every token of ``sequences`` but the first of each, with the two tokens and the region before it."""
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    regions = regions_after(tokens, starts, region_of_token)
    is_first = np.zeros(tokens.size, dtype=bool)
    is_first[starts] = True
    j = np.flatnonzero(~is_first)
    prev2 = np.where(is_first[j - 1], NO_TOKEN, tokens[j - 2])
    return _Events(nxt=tokens[j], prev1=tokens[j - 1], prev2=prev2, region=regions[j - 1])


def _unigram(
    events: _Events, region_of_token: np.ndarray, vocab_size: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The unigram fallback row (ids, probabilities) and the filler ids that pad short rows.

    Ordinary text tokens only (no markers, no EOS), so an unseen context continues text.
    """
    nxt = events.nxt
    text = nxt[(region_of_token[nxt] < 0) & (nxt > 2)]
    counts = np.bincount(text, minlength=vocab_size).astype(np.float64)
    by_count = np.lexsort((np.arange(vocab_size), -counts))
    uni_ids = by_count[:k]
    uni_probs = counts[uni_ids] / counts[uni_ids].sum()
    return uni_ids, uni_probs, by_count[: 2 * k].astype(np.int32)


def _bigram(
    events: _Events, v: np.int64, uni_ids: np.ndarray, uni_probs: np.ndarray, filler: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bigram rows per (region, prev1): maximum likelihood over the top k; unseen contexts get the unigram row."""
    ctx, tok, probs, rank = _top_k_rows(events.region * v + events.prev1, events.nxt, np.ones(events.nxt.size), k)
    bi_ids, bi_probs, filled = _dense(int(NUM_REGIONS * v), ctx, tok, probs, rank, k)
    unseen = filled == 0
    bi_ids[unseen] = uni_ids
    bi_probs[unseen] = uni_probs
    filled[unseen] = k
    _pad_rows(bi_ids, bi_probs, filled, filler)
    return bi_ids, bi_probs


def _trigram(
    events: _Events,
    v: np.int64,
    bi_ids: np.ndarray,
    bi_probs: np.ndarray,
    filler: np.ndarray,
    k: int,
    min_trigram_count: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trigram keys and rows for frequent contexts, interpolated with their bigram row (Witten-Bell).

    lambda = N / (N + T): N events of the context, T distinct next tokens.
    """
    has2 = events.prev2 >= 0
    tri_key = (events.region[has2] * v + events.prev2[has2]) * v + events.prev1[has2]
    tri_next = events.nxt[has2]
    keys, key_index, key_count = np.unique(tri_key, return_inverse=True, return_counts=True)
    frequent = key_count >= min_trigram_count
    remap = np.cumsum(frequent) - 1
    kept_event = frequent[key_index]
    keys, key_count = keys[frequent], key_count[frequent]
    key_index, tri_next = remap[key_index[kept_event]], tri_next[kept_event]
    pairs = np.unique(key_index * v + tri_next)
    distinct = np.bincount(pairs // v, minlength=keys.size)
    lam = key_count / (key_count + distinct)
    tri_weight = lam[key_index] / key_count[key_index]
    back_row = (keys // (v * v)) * v + keys % v  # region * v + prev1 of each trigram context
    back_ctx = np.repeat(np.arange(keys.size), k)
    back_tok = bi_ids[back_row].ravel().astype(np.int64)
    back_weight = ((1.0 - lam)[:, None] * bi_probs[back_row]).ravel()
    ctx, tok, probs, rank = _top_k_rows(
        np.r_[key_index, back_ctx], np.r_[tri_next, back_tok], np.r_[tri_weight, back_weight], k
    )
    tri_ids, tri_probs, filled = _dense(keys.size, ctx, tok, probs, rank, k)
    _pad_rows(tri_ids, tri_probs, filled, filler)
    return keys, tri_ids, tri_probs


def smoothed(in_context: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Probabilities of tokens under the smoothed model: ``(1 - SMOOTHING)`` times their probability among the
    context's candidates (0 outside them) plus ``SMOOTHING`` times their ``background`` probability. Never 0."""
    return (1.0 - SMOOTHING) * in_context + SMOOTHING * background

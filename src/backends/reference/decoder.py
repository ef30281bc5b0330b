"""One sampled token for each row of the reference engine's running batch, with DeepInfer's finish rules.

Candidates come from the n-gram model; then ``first_n_token_no_eos``, structured-output masks (only rows with
``so_args`` pay for them), temperature / top-k / top-p, a seeded draw, teacher forcing (``golden_token_ids``),
top logprobs, and the finish codes (EOS, ``max_tokens`` or ``max_model_len``, a failed grammar). Each call samples
the whole set of rows with a few numpy calls.
"""

from __future__ import annotations

import logging
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput, FinishReason

from . import sampler
from .batch import RunningBatch
from .model import NGramModel
from .sequence import SYNTHETIC_LOGPROB
from .structured import StructuredOutputs
from .structured_state import StructuredState

logger = logging.getLogger(__name__)

SO_FAILED_TOKEN = 0
"""DeepInfer appends token 0 when a request's grammar fails mid-generation (never to be detokenized)."""

_EMPTY: tuple[()] = ()
_REASONS = np.array(["", FinishReason.STOP, FinishReason.LENGTH, FinishReason.SO_FAILED], dtype=object)
_GOING, _STOPPED, _CAPPED, _SO_FAILED = 0, 1, 2, 3


class BatchDecoder:
    """Samples the running batch of one engine: its model, structured outputs and ``max_model_len``."""

    def __init__(
        self, model: NGramModel, structured: StructuredOutputs, max_model_len: int, tokens_per_step: int
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.tokens_per_step = tokens_per_step
        self._structured = structured

    def decode(self, batch: RunningBatch, outputs: list[EngineOutput], num_old: int) -> np.ndarray:
        """One decode round: each request emits ``tokens_per_step`` tokens (one if it was just admitted).

        Returns which rows of ``batch`` finished.
        """
        batch_size = len(batch.seqs)
        done = np.zeros(batch_size, dtype=bool)
        per_step = self.tokens_per_step
        if per_step == 1:
            outputs.extend(self._sample(batch, np.arange(batch_size), done))
        else:
            tagged: list[tuple[int, EngineOutput]] = []
            for sub_step in range(per_step):
                limit = batch_size if sub_step == 0 else num_old
                rows = np.flatnonzero(~done[:limit])
                if rows.size == 0:
                    break
                tagged.extend(zip(rows.tolist(), self._sample(batch, rows, done), strict=True))
            tagged.sort(key=itemgetter(0))  # stable: a request's tokens stay in order, grouped per request
            outputs.extend(out for _, out in tagged)
        return done

    def _sample(self, batch: RunningBatch, rows: np.ndarray, done: np.ndarray) -> list[EngineOutput]:
        """Sample one token for each of ``rows``, advance their state, mark finished rows in ``done``."""
        b = batch.arrays
        pos = b.pos[rows]
        ids, base = self.model.candidates(b.prev2[rows], b.prev1[rows], b.region[rows])
        ids = ids.astype(np.int64)
        probs = base.astype(np.float64)
        no_eos = b.no_eos_first[rows] & (pos == 0)
        if no_eos.any():
            self._mask_eos(ids, probs, np.flatnonzero(no_eos))
        structured = self._constrain(batch, rows, ids, probs, no_eos) if batch.num_so else None
        probs = sampler.process(probs, b.temperature[rows], b.top_k[rows], b.top_p[rows], b.greedy[rows])
        column = sampler.draw(probs, sampler.uniforms(b.key[rows], pos))
        index = np.arange(rows.size)
        tokens = ids[index, column]
        chosen = sampler.logprobs(probs[index, column])
        if b.golden[rows].any():
            self._teacher_force(batch, rows, pos, ids, probs, tokens, chosen)
        failed_rows = (
            self._advance_structured(batch, rows, structured, tokens, chosen) if structured is not None else None
        )
        count, code = self._advance(batch, rows, pos, tokens, failed_rows)
        done[rows] = code != _GOING
        n_top = b.n_top[rows]
        if failed_rows is not None:
            n_top = np.where(code == _SO_FAILED, 0, n_top)  # synthetic outputs carry no top logprobs
        top_values, top_tokens = _top_logprobs(ids, probs, n_top)
        return _engine_outputs(batch, rows, tokens, code, count, chosen, top_values, top_tokens)

    def _mask_eos(self, ids: np.ndarray, probs: np.ndarray, masked: np.ndarray) -> None:
        """``first_n_token_no_eos``: zero EOS among the candidates of the ``masked`` rows, in place."""
        sub = probs[masked]
        sub[ids[masked] == EOS_TOKEN_ID] = 0.0
        empty = sub.sum(axis=1) <= 0.0
        if empty.any():  # EOS was the only candidate: continue with ordinary text instead
            ids[masked[empty]] = self.model.unigram_ids
            sub[empty] = self.model.unigram_probs
        probs[masked] = sub

    def _advance(
        self,
        batch: RunningBatch,
        rows: np.ndarray,
        pos: np.ndarray,
        tokens: np.ndarray,
        failed_rows: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Advance the state of every sampled row; returns their token counts and finish codes."""
        b = batch.arrays
        region = self.model.region_of_token[tokens]
        b.region[rows] = np.where(region >= 0, region, b.region[rows])
        b.prev2[rows] = b.prev1[rows]
        b.prev1[rows] = tokens
        count = pos + 1
        b.pos[rows] = count
        stopped = (tokens == EOS_TOKEN_ID) & ~b.ignore_eos[rows]
        capped = (count >= b.max_tokens[rows]) | (b.prompt_len[rows] + count > self.max_model_len)
        code = np.where(stopped, _STOPPED, np.where(capped, _CAPPED, _GOING))
        if failed_rows is not None:
            code[failed_rows] = _SO_FAILED
        return count, code

    def _constrain(
        self, batch: RunningBatch, rows: np.ndarray, ids: np.ndarray, probs: np.ndarray, no_eos: np.ndarray
    ) -> tuple[np.ndarray, list[StructuredState], np.ndarray] | None:
        """Apply structured-output masks to the candidate rows of requests with so_args (in place).

        Returns (their indices in ``rows``, their states, which of them failed), or None if there are none.
        Only these rows pay for masks; the others keep their rows untouched, so their tokens do not change.
        """
        index = np.flatnonzero(batch.arrays.so[rows])
        if index.size == 0:
            return None
        running = batch.seqs
        states = [running[r].so for r in rows[index].tolist()]
        sub_ids, sub_probs = ids[index], probs[index]
        failed = self._structured.constrain(states, sub_ids, sub_probs, no_eos[index])
        if failed.any():  # keep failed rows drawable; their output is replaced after the draw
            sub_probs[failed, 0] = 1.0
        ids[index] = sub_ids
        probs[index] = sub_probs
        return index, states, failed

    def _advance_structured(
        self,
        batch: RunningBatch,
        rows: np.ndarray,
        structured: tuple[np.ndarray, list[StructuredState], np.ndarray],
        tokens: np.ndarray,
        chosen: np.ndarray,
    ) -> np.ndarray | None:
        """Feed emitted tokens to their grammars; rows that failed or were rejected emit DeepInfer's token 0.

        Returns the positions in the step's rows that finish as FINISHED_SO_FAILED, or None.
        """
        index, states, failed = structured
        live = np.flatnonzero(~failed)
        rejected = self._structured.advance([states[i] for i in live.tolist()], tokens[index[live]].tolist())
        failed[live[rejected]] = True
        if not failed.any():
            return None
        failed_rows = index[failed]
        for i, row in zip(np.flatnonzero(failed).tolist(), rows[failed_rows].tolist(), strict=True):
            seq = batch.seqs[row]
            seq.so_error = states[i].matcher.get_error() or f"token {int(tokens[index[i]])} rejected by the grammar"
            logger.info("request %s: structured output failed: %s", seq.request_id, seq.so_error)
        tokens[failed_rows] = SO_FAILED_TOKEN
        chosen[failed_rows] = SYNTHETIC_LOGPROB
        return failed_rows

    def _teacher_force(
        self,
        batch: RunningBatch,
        rows: np.ndarray,
        pos: np.ndarray,
        ids: np.ndarray,
        probs: np.ndarray,
        tokens: np.ndarray,
        chosen: np.ndarray,
    ) -> None:
        """``golden_token_ids``: replace sampled tokens position by position (evaluation, not serving)."""
        for i, row in enumerate(rows.tolist()):
            golden = batch.seqs[row].params.golden_token_ids
            position = int(pos[i])
            if not golden or position >= len(golden):
                continue
            token = int(golden[position])
            tokens[i] = token
            match = np.flatnonzero(ids[i] == token)
            chosen[i] = sampler.logprobs(probs[i, match[0]]) if match.size else sampler.LOGPROB_FLOOR


def _top_logprobs(ids: np.ndarray, probs: np.ndarray, n_top: np.ndarray) -> tuple[list[Any], list[Any]]:
    """Each row's ``n_top`` most likely candidates: their logprobs and token ids (empty where none are wanted)."""
    n = n_top.size
    top_values: list[Any] = [_EMPTY] * n
    top_tokens: list[Any] = [_EMPTY] * n
    wanted = np.flatnonzero(n_top > 0)
    if wanted.size:
        columns, values = sampler.top_logprobs(probs[wanted], int(n_top[wanted].max()))
        token_rows = np.take_along_axis(ids[wanted], columns, axis=1).tolist()
        value_rows = values.tolist()
        for j, (i, k) in enumerate(zip(wanted.tolist(), n_top[wanted].tolist(), strict=True)):
            top_values[i] = value_rows[j][:k]
            top_tokens[i] = token_rows[j][:k]
    return top_values, top_tokens


def _engine_outputs(
    batch: RunningBatch,
    rows: np.ndarray,
    tokens: np.ndarray,
    code: np.ndarray,
    count: np.ndarray,
    chosen: np.ndarray,
    top_values: list[Any],
    top_tokens: list[Any],
) -> list[EngineOutput]:
    """One ``EngineOutput`` per sampled row, built column-wise (no per-row branching when nothing finished)."""
    n = rows.size
    all_rows = n == len(batch.request_ids)
    request_ids = batch.request_ids if all_rows else [batch.request_ids[i] for i in rows.tolist()]
    prompt_lens = batch.prompt_lens if all_rows else [batch.prompt_lens[i] for i in rows.tolist()]
    finished = code != _GOING
    any_finished = bool(finished.any())
    return list(
        map(
            EngineOutput,
            request_ids,
            tokens.tolist(),
            finished.tolist() if any_finished else repeat(False, n),
            _REASONS[code].tolist() if any_finished else repeat("", n),
            count.tolist(),
            prompt_lens,
            chosen.tolist(),
            top_values,
            top_tokens,
        )
    )

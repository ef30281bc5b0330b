"""The CPU reference engine: DeepInfer's ``LLMEngine`` API and scheduling semantics over the n-gram model.

It is the gateway's embedded default and the engine every serving test runs on, so it reproduces the behaviour
the driver above it must handle: FIFO admission up to ``max_num_seqs``, ``prompt_length_exceeded`` for prompts
over ``max_model_len``, one output per emitted token, EOS id 1 stops, silent drops of out-of-range token ids, and
DeepInfer's abort rule (aborted while waiting: one synthetic ``abort`` output; aborted while running: nothing).
An optional timing model (seconds per prefill token, per decode step, tokens accepted per step) makes it pace
like a GPU deployment for load tests. Each step samples the whole batch with a few numpy calls.

Structured outputs (``so_args``, see ``structured``) follow DeepInfer's contract, with these differences: the
grammar is compiled before ``add_request`` by ``compile_so_args``, which the gateway calls on its preparation pool
(``so_args`` that did not go through it are compiled synchronously inside ``add_request``); DeepInfer compiles on
its own thread pool and enqueues the request from a later ``step()``, so until then ``abort_request`` cannot see
it, while here the request is queued at once. A schema that fails to compile
still ends the request asynchronously, with one synthetic ``FINISHED_SO_FAILED`` output (last prompt token) at the
next step, and ``abort_request`` does not count it, as with a pending compile. A grammar failing mid-generation
emits token 0 with that finish reason. There is no KV-cache preemption here, so "structured requests are stopped
when preempted" never arises. Only rows with ``so_args`` pay for masks; the others take the unchanged numpy path.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput, FinishReason

from . import sampler
from .artifacts import load_or_build
from .model import NO_TOKEN, NGramModel, regions_after, smoothed
from .sampling_params import SamplingParams
from .structured import StructuredOutputError, StructuredOutputs, StructuredState, check_so_args
from .tokenizer import DEFAULT_VOCAB_SIZE, SpecialTokenIds

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
"""Top-logprob lists are capped at this length (OpenAI's maximum); DeepInfer accepts up to 1000."""

SYNTHETIC_LOGPROB = 1.0
"""DeepInfer's ``token_logprobs`` on outputs whose token was never sampled."""

SO_FAILED_TOKEN = 0
"""DeepInfer appends token 0 when a request's grammar fails mid-generation (never to be detokenized)."""

_EMPTY: tuple[()] = ()
_REASONS = np.array(["", FinishReason.STOP, FinishReason.LENGTH, FinishReason.SO_FAILED], dtype=object)
_GOING, _STOPPED, _CAPPED, _SO_FAILED = 0, 1, 2, 3


class SequenceStatus:
    """DeepInfer's ``SequenceStatus`` values for the states the reference engine uses."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_SO_FAILED = 8


@dataclass(slots=True)
class ReferenceEngineArgs:
    """Engine arguments; the timing model is off by default (zero seconds, one token per step)."""

    max_model_len: int = 4096
    max_num_seqs: int = 256
    seed: int | None = None  # seeds the seq_seed of requests that bring none; None: random like DeepInfer
    cache_dir: str | Path | None = None  # None: $DEEPINFER_GATEWAY_CACHE or ~/.cache/deepinfer-gateway
    vocab_size: int = DEFAULT_VOCAB_SIZE  # BPE vocabulary size to train (the engine adds its text markers)
    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_step: float = 0.0
    tokens_per_step: int = 1  # accepted tokens per decode step, imitating speculative decoding

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_seqs < 1 or self.tokens_per_step < 1:
            raise ValueError("max_model_len, max_num_seqs and tokens_per_step must be at least 1")
        if self.prefill_seconds_per_token < 0 or self.decode_seconds_per_step < 0:
            raise ValueError("timing model durations must be non-negative")


class ReferenceSequence:
    """What ``add_request`` returns (DeepInfer returns its C++ ``Sequence``): identity, status, lengths."""

    __slots__ = (
        "last_prompt_token",
        "params",
        "prev1",
        "prev2",
        "prompt_len",
        "prompt_logprobs",
        "region",
        "request_id",
        "so",
        "so_error",
        "status",
        "user_id",
    )

    def __init__(self, user_id: str, request_id: str, params: SamplingParams, prompt: np.ndarray, region: int) -> None:
        self.user_id = user_id
        self.request_id = request_id
        self.params = params
        self.so: StructuredState | None = None  # structured-output state, if the request has so_args
        self.so_error = ""  # why it ended as FINISHED_SO_FAILED (compile error, or grammar error mid-generation)
        self.prompt_len = int(prompt.size)
        self.last_prompt_token = int(prompt[-1])
        self.prev1 = self.last_prompt_token
        self.prev2 = int(prompt[-2]) if prompt.size > 1 else NO_TOKEN
        self.region = region
        self.status = SequenceStatus.WAITING
        self.prompt_logprobs: list[float] | None = None  # sent on the first output, if the request asked

    def synthetic_output(self, reason: str) -> EngineOutput:
        """The single output of a request that never ran: its last prompt token, never to be detokenized."""
        return EngineOutput(
            self.request_id, self.last_prompt_token, True, reason, 1, self.prompt_len, SYNTHETIC_LOGPROB, (), ()
        )


class _Batch:
    """Per-request decode state of the running requests as parallel numpy arrays, in admission order."""

    FIELDS = (
        "prev2",
        "prev1",
        "region",
        "key",
        "pos",
        "prompt_len",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "greedy",
        "ignore_eos",
        "no_eos_first",
        "n_top",
        "golden",
        "so",
    )
    prev2: np.ndarray
    prev1: np.ndarray
    region: np.ndarray
    key: np.ndarray
    pos: np.ndarray
    prompt_len: np.ndarray
    max_tokens: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    greedy: np.ndarray
    ignore_eos: np.ndarray
    no_eos_first: np.ndarray
    n_top: np.ndarray
    golden: np.ndarray
    so: np.ndarray

    def __init__(self) -> None:
        self._assign(self.rows([], width=1))

    @staticmethod
    def rows(seqs: Sequence[ReferenceSequence], width: int) -> dict[str, np.ndarray]:
        params = [s.params for s in seqs]
        seeds = np.array([p.seq_seed for p in params], dtype=np.uint64)
        return {
            "prev2": np.array([s.prev2 for s in seqs], dtype=np.int64),
            "prev1": np.array([s.prev1 for s in seqs], dtype=np.int64),
            "region": np.array([s.region for s in seqs], dtype=np.int64),
            "key": sampler.stream_keys(seeds),
            "pos": np.zeros(len(seqs), dtype=np.int64),
            "prompt_len": np.array([s.prompt_len for s in seqs], dtype=np.int64),
            "max_tokens": np.array([p.max_tokens for p in params], dtype=np.int64),
            "temperature": np.array([p.temperature for p in params], dtype=np.float64),
            "top_k": np.array([width if p.top_k == -1 else min(p.top_k, width) for p in params], dtype=np.int64),
            "top_p": np.array([p.top_p for p in params], dtype=np.float64),
            "greedy": np.array([p.greedy for p in params], dtype=bool),
            "ignore_eos": np.array([bool(p.ignore_eos) for p in params], dtype=bool),
            "no_eos_first": np.array([p.first_n_token_no_eos == 1 for p in params], dtype=bool),
            "n_top": np.array([min(p.top_logprobs, MAX_TOP_LOGPROBS) for p in params], dtype=np.int64),
            "golden": np.array([bool(p.golden_token_ids) for p in params], dtype=bool),
            "so": np.array([s.so is not None for s in seqs], dtype=bool),
        }

    def _assign(self, arrays: dict[str, np.ndarray]) -> None:
        for name in self.FIELDS:
            setattr(self, name, arrays[name])

    def extend(self, arrays: dict[str, np.ndarray]) -> None:
        self._assign({name: np.concatenate((getattr(self, name), arrays[name])) for name in self.FIELDS})

    def keep(self, mask: np.ndarray) -> None:
        self._assign({name: getattr(self, name)[mask] for name in self.FIELDS})


class ReferenceEngine:
    """A small real engine for CPUs with DeepInfer's ``LLMEngine`` methods (see ``backends.engine.protocol``).

    Like DeepInfer's engine, it must be driven from one thread.
    """

    def __init__(
        self,
        args: ReferenceEngineArgs,
        tokenizer: Tokenizer,
        model: NGramModel,
        special: SpecialTokenIds,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model = model
        self.special_token_ids = special
        self.max_model_len = args.max_model_len
        self.max_num_seqs = args.max_num_seqs
        self.vocab_size = model.vocab_size
        self.eos_id = EOS_TOKEN_ID
        self._seed_source = random.Random(args.seed) if args.seed is not None else None
        self._live: dict[str, ReferenceSequence] = {}
        self._waiting: deque[ReferenceSequence] = deque()
        self._num_waiting = 0
        self._running: list[ReferenceSequence] = []
        self._running_ids: list[str] = []
        self._running_prompt_lens: list[int] = []
        self._batch = _Batch()
        self._pending: list[EngineOutput] = []  # synthetic outputs due at the next step
        self._closed = False
        self._background = model.background()  # smooths prompt logprobs (a few ms, once)
        self._structured = StructuredOutputs(tokenizer, model, EOS_TOKEN_ID)
        self._num_so = 0  # running requests with so_args: zero keeps _sample on its plain path

    @classmethod
    def from_engine_args(cls, args: ReferenceEngineArgs) -> ReferenceEngine:
        """Load the tokenizer and model from the cache (building them on first use) and make an engine."""
        artifacts = load_or_build(args.cache_dir, args.vocab_size)
        return cls(args, artifacts.tokenizer, artifacts.model, artifacts.special)

    # ---- requests -------------------------------------------------------------------------------------------

    def compile_so_args(self, so_args: Mapping[str, Any]) -> Mapping[str, Any]:
        """Compiles the grammar of ``so_args`` on the calling thread, for ``add_request`` to pick up (thread-safe:
        ``StructuredOutputCompiler``, called from the gateway's preparation pool, never from the engine thread)."""
        return self._structured.prepare(so_args)

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | SamplingParams | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> ReferenceSequence | None:
        """Queue a request; returns ``None`` (request dropped) if a token id is outside the vocabulary."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if multi_modal_data:
            raise ValueError("multi_modal_data is not supported by the reference engine")
        if self._seed_source is not None:
            if sampling_params is None:
                sampling_params = {}
            if isinstance(sampling_params, dict) and sampling_params.get("seq_seed") is None:
                sampling_params = {**sampling_params, "seq_seed": self._seed_source.getrandbits(64)}
        params = SamplingParams.from_request(sampling_params)
        params.eos_id = EOS_TOKEN_ID
        golden = params.golden_token_ids
        if golden and not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in golden):
            raise ValueError("golden_token_ids must be token ids within the vocabulary")
        prompt = prompt_token_ids
        if not (
            isinstance(prompt, np.ndarray)
            and prompt.dtype == np.int32
            and prompt.ndim == 1
            and prompt.flags.c_contiguous
        ):
            raise TypeError("prompt_token_ids must be a 1-D C-contiguous numpy array of dtype int32")
        if prompt.size == 0:
            raise ValueError("prompt must not be empty")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size:
            return None
        so_args = params.so_args
        if so_args is not None:
            check_so_args(so_args)
        seq = ReferenceSequence(user_id, request_id, params, prompt, self.model.region_after(prompt))
        if params.prompt_logprobs:
            seq.prompt_logprobs = prompt_logprobs(self.model, prompt, self._background)
        self._live[request_id] = seq
        if so_args is not None:
            # DeepInfer compiles on a thread pool and enqueues the request from a later step(); here the grammar
            # was compiled by compile_so_args (or is compiled now, cached per schema), so the request is visible
            # to abort_request at once.
            try:
                seq.so = self._structured.compile(so_args)
            except StructuredOutputError as exc:
                seq.so_error = str(exc)
                logger.info("request %s: so_args failed: %s", request_id, exc)
                seq.status = SequenceStatus.FINISHED_SO_FAILED
                self._pending.append(seq.synthetic_output(FinishReason.SO_FAILED))
                return seq
        self._waiting.append(seq)
        self._num_waiting += 1
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        """Abort live requests; returns (number aborted, sum of their lengths). Running aborts emit nothing."""
        ids: Iterable[str]
        if isinstance(request_id, str):
            ids = (request_id,)
        elif isinstance(request_id, dict | set | list | tuple):
            ids = request_id
        else:
            raise TypeError(f"request_id must be a str or a collection of str, not {type(request_id).__name__}")
        count = 0
        length = 0
        stopped_running = False
        for rid in ids:
            seq = self._live.get(rid)
            if seq is None or seq.status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
                continue
            count += 1
            if seq.status == SequenceStatus.WAITING:
                length += seq.prompt_len
                self._num_waiting -= 1
                self._pending.append(seq.synthetic_output(FinishReason.ABORT))
            else:
                stopped_running = True
                del self._live[rid]
            seq.status = SequenceStatus.FINISHED_ABORTED
        if stopped_running:
            batch_pos = self._batch.pos
            keep = np.array([s.status == SequenceStatus.RUNNING for s in self._running], dtype=bool)
            for row in np.flatnonzero(~keep).tolist():
                length += self._running[row].prompt_len + int(batch_pos[row])
            self._retain(keep)
        return count, length

    def has_unfinished_requests(self) -> bool:
        return bool(self._num_waiting or self._running or self._pending)

    def get_num_unfinished_requests(self) -> int:
        return self._num_waiting + len(self._running) + len(self._pending)

    def flush_inflight_reqs(self) -> list[EngineOutput]:
        """Nothing is ever in flight here (no zero-overhead scheduling); returns any due synthetic outputs."""
        return self._take_pending()

    def close(self) -> None:
        """Drop every request; the engine accepts no more work."""
        self._closed = True
        self._live.clear()
        self._waiting.clear()
        self._num_waiting = 0
        self._retain(np.zeros(len(self._running), dtype=bool))
        self._pending.clear()

    # ---- stepping -------------------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Admit waiting requests (prefill, first token), then decode every earlier running request."""
        started = time.perf_counter()
        outputs = self._take_pending()
        num_old = len(self._running)
        prefill_tokens, scored = self._admit(outputs)
        if self._running:
            self._decode(outputs, num_old)
        if scored:
            _attach_prompt_logprobs(outputs, scored)
        delay = self.args.prefill_seconds_per_token * prefill_tokens
        if num_old:
            delay += self.args.decode_seconds_per_step
        if delay > 0.0:
            remaining = delay - (time.perf_counter() - started)
            if remaining > 0.0:
                time.sleep(remaining)
        return outputs

    def _take_pending(self) -> list[EngineOutput]:
        outputs = self._pending
        self._pending = []
        for out in outputs:
            self._live.pop(out.request_id, None)
        return outputs

    def _admit(self, outputs: list[EngineOutput]) -> tuple[int, dict[str, list[float]]]:
        """FIFO admission: too-long prompts finish as ``prompt_length_exceeded``; the rest fill free slots.

        Returns the prefill token count and the prompt logprobs of admitted requests that asked for them.
        """
        admitted: list[ReferenceSequence] = []
        free = self.max_num_seqs - len(self._running)
        prefill_tokens = 0
        waiting = self._waiting
        while waiting:
            seq = waiting[0]
            if seq.status != SequenceStatus.WAITING:  # aborted while waiting; its output is already pending
                waiting.popleft()
                continue
            if seq.prompt_len > self.max_model_len:
                waiting.popleft()
                self._num_waiting -= 1
                seq.status = SequenceStatus.FINISHED_IGNORED
                del self._live[seq.request_id]
                outputs.append(seq.synthetic_output(FinishReason.PROMPT_LENGTH_EXCEEDED))
                continue
            if len(admitted) >= free:
                break
            waiting.popleft()
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            prefill_tokens += seq.prompt_len
        if admitted:
            self._batch.extend(_Batch.rows(admitted, self.model.top_k))
            self._running.extend(admitted)
            self._running_ids.extend(s.request_id for s in admitted)
            self._running_prompt_lens.extend(s.prompt_len for s in admitted)
            self._num_so = int(np.count_nonzero(self._batch.so))
        scored = {s.request_id: s.prompt_logprobs for s in admitted if s.prompt_logprobs is not None}
        return prefill_tokens, scored  # type: ignore[return-value]

    def _retain(self, keep: np.ndarray) -> None:
        self._batch.keep(keep)
        flags = keep.tolist()
        self._running = [s for s, k in zip(self._running, flags, strict=True) if k]
        self._running_ids = [s.request_id for s in self._running]
        self._running_prompt_lens = [s.prompt_len for s in self._running]
        self._num_so = int(np.count_nonzero(self._batch.so))

    def _decode(self, outputs: list[EngineOutput], num_old: int) -> None:
        """One decode round: each request emits ``tokens_per_step`` tokens (one if it was just admitted)."""
        batch_size = len(self._running)
        done = np.zeros(batch_size, dtype=bool)
        per_step = self.args.tokens_per_step
        if per_step == 1:
            outputs.extend(self._sample(np.arange(batch_size), done))
        else:
            tagged: list[tuple[int, EngineOutput]] = []
            for sub_step in range(per_step):
                limit = batch_size if sub_step == 0 else num_old
                rows = np.flatnonzero(~done[:limit])
                if rows.size == 0:
                    break
                tagged.extend(zip(rows.tolist(), self._sample(rows, done), strict=True))
            tagged.sort(key=itemgetter(0))  # stable: a request's tokens stay in order, grouped per request
            outputs.extend(out for _, out in tagged)
        if done.any():
            for row in np.flatnonzero(done).tolist():
                seq = self._running[row]
                del self._live[seq.request_id]
            self._retain(~done)

    def _sample(self, rows: np.ndarray, done: np.ndarray) -> list[EngineOutput]:
        """Sample one token for each of ``rows``, advance their state, mark finished rows in ``done``."""
        b = self._batch
        model = self.model
        eos = EOS_TOKEN_ID
        pos = b.pos[rows]
        ids, base = model.candidates(b.prev2[rows], b.prev1[rows], b.region[rows])
        ids = ids.astype(np.int64)
        probs = base.astype(np.float64)
        no_eos = b.no_eos_first[rows] & (pos == 0)
        if no_eos.any():
            masked = np.flatnonzero(no_eos)
            sub = probs[masked]
            sub[ids[masked] == eos] = 0.0
            empty = sub.sum(axis=1) <= 0.0
            if empty.any():  # EOS was the only candidate: continue with ordinary text instead
                ids[masked[empty]] = model.unigram_ids
                sub[empty] = model.unigram_probs
            probs[masked] = sub
        structured = self._constrain(rows, ids, probs, no_eos) if self._num_so else None
        probs = sampler.process(probs, b.temperature[rows], b.top_k[rows], b.top_p[rows], b.greedy[rows])
        column = sampler.draw(probs, sampler.uniforms(b.key[rows], pos))
        index = np.arange(rows.size)
        tokens = ids[index, column]
        chosen = sampler.logprobs(probs[index, column])
        if b.golden[rows].any():
            self._teacher_force(rows, pos, ids, probs, tokens, chosen)
        failed_rows = self._advance_structured(rows, structured, tokens, chosen) if structured is not None else None

        # Advance the state of every sampled row.
        region = model.region_of_token[tokens]
        b.region[rows] = np.where(region >= 0, region, b.region[rows])
        b.prev2[rows] = b.prev1[rows]
        b.prev1[rows] = tokens
        count = pos + 1
        b.pos[rows] = count
        stopped = (tokens == eos) & ~b.ignore_eos[rows]
        capped = (count >= b.max_tokens[rows]) | (b.prompt_len[rows] + count > self.max_model_len)
        code = np.where(stopped, _STOPPED, np.where(capped, _CAPPED, _GOING))
        if failed_rows is not None:
            code[failed_rows] = _SO_FAILED
        finished = code != _GOING
        done[rows] = finished

        n = rows.size
        top_values: list[Any] = [_EMPTY] * n
        top_tokens: list[Any] = [_EMPTY] * n
        n_top = b.n_top[rows]
        if failed_rows is not None:
            n_top = np.where(code == _SO_FAILED, 0, n_top)  # synthetic outputs carry no top logprobs
        wanted = np.flatnonzero(n_top > 0)
        if wanted.size:
            columns, values = sampler.top_logprobs(probs[wanted], int(n_top[wanted].max()))
            token_rows = np.take_along_axis(ids[wanted], columns, axis=1).tolist()
            value_rows = values.tolist()
            for j, (i, k) in enumerate(zip(wanted.tolist(), n_top[wanted].tolist(), strict=True)):
                top_values[i] = value_rows[j][:k]
                top_tokens[i] = token_rows[j][:k]

        all_rows = n == len(self._running_ids)
        request_ids = self._running_ids if all_rows else [self._running_ids[i] for i in rows.tolist()]
        prompt_lens = self._running_prompt_lens if all_rows else [self._running_prompt_lens[i] for i in rows.tolist()]
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

    def _constrain(
        self, rows: np.ndarray, ids: np.ndarray, probs: np.ndarray, no_eos: np.ndarray
    ) -> tuple[np.ndarray, list[StructuredState], np.ndarray] | None:
        """Apply structured-output masks to the candidate rows of requests with so_args (in place).

        Returns (their indices in ``rows``, their states, which of them failed), or None if there are none.
        Only these rows pay for masks; the others keep their rows untouched, so their tokens do not change.
        """
        index = np.flatnonzero(self._batch.so[rows])
        if index.size == 0:
            return None
        running = self._running
        states = [running[r].so for r in rows[index].tolist()]
        sub_ids, sub_probs = ids[index], probs[index]
        failed = self._structured.constrain(states, sub_ids, sub_probs, no_eos[index])  # type: ignore[arg-type]
        if failed.any():  # keep failed rows drawable; their output is replaced after the draw
            sub_probs[failed, 0] = 1.0
        ids[index] = sub_ids
        probs[index] = sub_probs
        return index, states, failed  # type: ignore[return-value]

    def _advance_structured(
        self,
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
            seq = self._running[row]
            seq.so_error = states[i].matcher.get_error() or f"token {int(tokens[index[i]])} rejected by the grammar"
            logger.info("request %s: structured output failed: %s", seq.request_id, seq.so_error)
        tokens[failed_rows] = SO_FAILED_TOKEN
        chosen[failed_rows] = SYNTHETIC_LOGPROB
        return failed_rows

    def _teacher_force(
        self,
        rows: np.ndarray,
        pos: np.ndarray,
        ids: np.ndarray,
        probs: np.ndarray,
        tokens: np.ndarray,
        chosen: np.ndarray,
    ) -> None:
        """``golden_token_ids``: replace sampled tokens position by position (evaluation, not serving)."""
        for i, row in enumerate(rows.tolist()):
            golden = self._running[row].params.golden_token_ids
            position = int(pos[i])
            if not golden or position >= len(golden):
                continue
            token = int(golden[position])
            tokens[i] = token
            match = np.flatnonzero(ids[i] == token)
            chosen[i] = sampler.logprobs(probs[i, match[0]]) if match.size else sampler.LOGPROB_FLOOR


def _attach_prompt_logprobs(outputs: list[EngineOutput], scored: dict[str, list[float]]) -> None:
    """Put each scored request's prompt logprobs on its first output (the prompt step's), as DeepInfer does."""
    for position, out in enumerate(outputs):
        values = scored.pop(out.request_id, None)
        if values is not None:
            outputs[position] = out._replace(prompt_logprobs=values)
            if not scored:
                return


def prompt_logprobs(model: NGramModel, prompt: np.ndarray, background: np.ndarray) -> list[float]:
    """Logprob of each prompt token after the first given the tokens before it, from the same candidate rows that
    sampling uses (unprocessed: no temperature, top-k or top-p), smoothed (``model.smoothed``): a token outside
    its context's top ``K`` keeps a small, finite probability, as under a real model, so the logprobs of any
    text sum to a finite number (word perplexity). ``background`` is ``model.background()``, computed once."""
    tokens = prompt.astype(np.int64)
    if tokens.size < 2:
        return []
    regions = regions_after(tokens, np.zeros(1, dtype=np.int64), model.region_of_token)
    prev2 = np.r_[NO_TOKEN, tokens[:-2]]
    ids, probs = model.candidates(prev2, tokens[:-1], regions[:-1])
    weights = probs.astype(np.float64)
    totals = np.maximum(weights.sum(axis=1), np.finfo(np.float64).tiny)
    chosen = ((ids.astype(np.int64) == tokens[1:, None]) * weights).sum(axis=1) / totals
    return np.log(smoothed(chosen, background[tokens[1:]])).tolist()  # type: ignore[no-any-return]

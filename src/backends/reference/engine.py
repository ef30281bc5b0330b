"""The CPU reference engine: DeepInfer's ``LLMEngine`` API and scheduling semantics over the n-gram model.

It is the gateway's embedded default and the engine every serving test runs on, so it reproduces the behaviour
the driver above it must handle: FIFO admission up to ``max_num_seqs``, ``prompt_length_exceeded`` for prompts
over ``max_model_len``, one output per emitted token, EOS id 1 stops, silent drops of out-of-range token ids, and
DeepInfer's abort rule (aborted while waiting: one synthetic ``abort`` output; aborted while running: nothing).
An optional timing model (seconds per prefill token, per decode step, tokens accepted per step) makes it pace
like a GPU deployment for load tests. Each step samples the whole batch with a few numpy calls.

Images (``multi_modal_data``) are taken as DeepInfer takes them: each placeholder expands into the image's tokens
before the ids are checked (``images``), and the images' bytes seed the request's sampling.

This module is the ``LLMEngine`` surface and FIFO admission; the request state is in ``sequence``, the running
batch in ``batch``, sampling and finish rules in ``decoder``, the timing model in ``timing``, and prompt logprobs
in ``prompt_scoring``.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput, FinishReason, MetricSample

from .artifacts import load_or_build
from .batch import RunningBatch
from .decoder import BatchDecoder
from .images import IMAGE_TOKEN_SLACK, expand_images
from .model import NGramModel
from .prefix_cache import PrefixCache
from .prompt_scoring import attach_prompt_logprobs, prompt_logprobs
from .sampling_params import SamplingParams
from .sequence import ReferenceSequence, SequenceStatus
from .structured import StructuredOutputError, StructuredOutputs, check_so_args
from .timing import TimingModel
from .tokenizer import DEFAULT_VOCAB_SIZE, IMAGE, SpecialTokenIds

logger = logging.getLogger(__name__)


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
    prefix_cache_tokens: int = 0  # prompt tokens the prefix cache keeps (LRU, in whole blocks); 0: no prefix cache
    prefix_cache_block_size: int = 16  # tokens per cached block: a hit is a whole number of blocks

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_seqs < 1 or self.tokens_per_step < 1:
            raise ValueError("max_model_len, max_num_seqs and tokens_per_step must be at least 1")
        if self.prefix_cache_tokens < 0 or self.prefix_cache_block_size < 1:
            raise ValueError("prefix_cache_tokens must be non-negative and prefix_cache_block_size at least 1")
        if self.prefill_seconds_per_token < 0 or self.decode_seconds_per_step < 0:
            raise ValueError("timing model durations must be non-negative")


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
        self._image_token = tokenizer.token_to_id(IMAGE)  # expanded by add_request's multi_modal_data
        self.max_model_len = args.max_model_len
        self.max_num_seqs = args.max_num_seqs
        self.vocab_size = model.vocab_size
        self.eos_id = EOS_TOKEN_ID
        self._seed_source = random.Random(args.seed) if args.seed is not None else None
        self._live: dict[str, ReferenceSequence] = {}
        self._waiting: deque[ReferenceSequence] = deque()
        self._num_waiting = 0
        self._running = RunningBatch()
        self._pending: list[EngineOutput] = []  # synthetic outputs due at the next step
        self._closed = False
        self._background = model.background()  # smooths prompt logprobs (a few ms, once)
        self._structured = StructuredOutputs(tokenizer, model, EOS_TOKEN_ID)
        self._decoder = BatchDecoder(model, self._structured, args.max_model_len, args.tokens_per_step)
        self._timing = TimingModel(args.prefill_seconds_per_token, args.decode_seconds_per_step)
        blocks = args.prefix_cache_tokens // args.prefix_cache_block_size
        self.prefix_cache = PrefixCache(args.prefix_cache_block_size, blocks) if blocks else None
        self.prefix_cache_queried_tokens = 0  # prompt tokens of the requests admitted so far
        self.prefix_cache_hit_tokens = 0  # of those, the tokens found in the prefix cache (not prefilled)

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
        params = self._sampling_params(sampling_params)
        prompt = prompt_token_ids
        _check_prompt_array(prompt)
        images = None
        if multi_modal_data is not None:  # DeepInfer expands the placeholders first, then checks the ids
            images = expand_images(prompt, self._image_token, self.vocab_size, multi_modal_data)
            params.seq_seed ^= images.digest
        tokens = images.tokens if images is not None else prompt
        if tokens.size == 0:
            raise ValueError("prompt must not be empty")
        slack = IMAGE_TOKEN_SLACK if images is not None else 0
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size + slack:
            return None
        text = images.text if images is not None else prompt
        if text.size == 0:
            raise ValueError("prompt must hold text besides its images")
        so_args = params.so_args
        if so_args is not None:
            check_so_args(so_args)
        seq = ReferenceSequence(user_id, request_id, params, text, self.model.region_after(text))
        seq.prompt_len = int(tokens.size)
        if self.prefix_cache is not None:
            seq.block_keys = self.prefix_cache.block_keys(images.cache_keys if images is not None else prompt)
        if params.prompt_logprobs:
            seq.prompt_logprobs = prompt_logprobs(self.model, text, self._background)
        self._live[request_id] = seq
        if so_args is not None and not self._compile_grammar(seq, so_args):
            return seq
        self._waiting.append(seq)
        self._num_waiting += 1
        return seq

    def _sampling_params(self, sampling_params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """The request's sampling parameters, seeded from the engine's seed when it brings none."""
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
        return params

    def _compile_grammar(self, seq: ReferenceSequence, so_args: Mapping[str, Any]) -> bool:
        """Attach the compiled grammar to ``seq``; if it does not compile, finish ``seq`` with ``so_failed`` (an
        output for the next step) and return False.

        DeepInfer compiles on a thread pool and enqueues the request from a later step(); here the grammar was
        compiled by compile_so_args (or is compiled now, cached per schema), so the request is visible to
        abort_request at once.
        """
        try:
            seq.so = self._structured.compile(so_args)
        except StructuredOutputError as exc:
            seq.so_error = str(exc)
            logger.info("request %s: so_args failed: %s", seq.request_id, exc)
            seq.status = SequenceStatus.FINISHED_SO_FAILED
            self._pending.append(seq.synthetic_output(FinishReason.SO_FAILED))
            return False
        return True

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
            running = self._running.seqs
            batch_pos = self._running.arrays.pos
            keep = np.array([s.status == SequenceStatus.RUNNING for s in running], dtype=bool)
            for row in np.flatnonzero(~keep).tolist():
                length += running[row].prompt_len + int(batch_pos[row])
            self._running.retain(keep)
        return count, length

    def has_unfinished_requests(self) -> bool:
        return bool(self._num_waiting or self._running.seqs or self._pending)

    def get_num_unfinished_requests(self) -> int:
        return self._num_waiting + len(self._running.seqs) + len(self._pending)

    def flush_inflight_reqs(self) -> list[EngineOutput]:
        """Nothing is ever in flight here (no zero-overhead scheduling); returns any due synthetic outputs."""
        return self._take_pending()

    def close(self) -> None:
        """Drop every request; the engine accepts no more work."""
        self._closed = True
        self._live.clear()
        self._waiting.clear()
        self._num_waiting = 0
        self._running.retain(np.zeros(len(self._running.seqs), dtype=bool))
        self._pending.clear()

    # ---- stepping -------------------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Admit waiting requests (prefill, first token), then decode every earlier running request."""
        started = time.perf_counter()
        outputs = self._take_pending()
        num_old = len(self._running.seqs)
        prefill_tokens, scored, cached = self._admit(outputs)
        if self._running.seqs:
            self._decode(outputs, num_old)
        if scored:
            attach_prompt_logprobs(outputs, scored)
        if cached:
            attach_cached_tokens(outputs, cached)
        self._timing.pace(started, prefill_tokens, bool(num_old))
        return outputs

    def _take_pending(self) -> list[EngineOutput]:
        outputs = self._pending
        self._pending = []
        for out in outputs:
            self._live.pop(out.request_id, None)
        return outputs

    def _admit(self, outputs: list[EngineOutput]) -> tuple[int, dict[str, list[float]], dict[str, int]]:
        """FIFO admission: too-long prompts finish as ``prompt_length_exceeded``; the rest fill free slots.

        Returns the prefill token count (prompt tokens not found in the prefix cache), the prompt logprobs of
        admitted requests that asked for them, and the cached prompt tokens of those that hit the prefix cache.
        """
        admitted: list[ReferenceSequence] = []
        free = self.max_num_seqs - len(self._running.seqs)
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
        cached: dict[str, int] = {}
        if admitted:
            self._running.admit(admitted, self.model.top_k)
            self.prefix_cache_queried_tokens += prefill_tokens
            if self.prefix_cache is not None:
                cached = self._reuse_prefixes(admitted)
                prefill_tokens -= sum(cached.values())
        scored = {s.request_id: s.prompt_logprobs for s in admitted if s.prompt_logprobs is not None}
        return prefill_tokens, scored, cached

    def _reuse_prefixes(self, admitted: list[ReferenceSequence]) -> dict[str, int]:
        """The cached prompt tokens of each admitted request that hit; then every admitted prompt's blocks are
        cached (after all lookups: requests prefilled in the same step do not share their work)."""
        cache = self.prefix_cache
        assert cache is not None
        cached: dict[str, int] = {}
        for seq in admitted:
            hit = cache.lookup(seq.block_keys)
            if hit:
                cached[seq.request_id] = hit
        for seq in admitted:
            cache.insert(seq.block_keys)
            seq.block_keys = []
        self.prefix_cache_hit_tokens += sum(cached.values())
        return cached

    # ---- metrics --------------------------------------------------------------------------------------------

    def metric_samples(self) -> list[MetricSample]:
        """Prefix-cache counters for ``/metrics`` (plain ints the engine thread updates; read from any thread)."""
        return [
            MetricSample(
                "engine_prefix_cache_queried_tokens",
                "counter",
                "Prompt tokens of the requests the engine admitted (looked up in its prefix cache).",
                self.prefix_cache_queried_tokens,
            ),
            MetricSample(
                "engine_prefix_cache_hit_tokens",
                "counter",
                "Of those, the prompt tokens found in the prefix cache, whose prefill was skipped.",
                self.prefix_cache_hit_tokens,
            ),
        ]

    def _decode(self, outputs: list[EngineOutput], num_old: int) -> None:
        """One decode round (``BatchDecoder.decode``); finished requests leave the batch."""
        running = self._running
        done = self._decoder.decode(running, outputs, num_old)
        if done.any():
            for row in np.flatnonzero(done).tolist():
                seq = running.seqs[row]
                del self._live[seq.request_id]
            running.retain(~done)


def attach_cached_tokens(outputs: list[EngineOutput], cached: dict[str, int]) -> None:
    """Put each request's cached prompt tokens on its first output (the prompt step's)."""
    for position, out in enumerate(outputs):
        hit = cached.pop(out.request_id, None)
        if hit is not None:
            outputs[position] = out._replace(num_cached_tokens=hit)
            if not cached:
                return


def _check_prompt_array(prompt: Any) -> None:
    """DeepInfer takes prompts only as 1-D C-contiguous int32 numpy arrays; anything else is a TypeError."""
    if not (
        isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and prompt.ndim == 1 and prompt.flags.c_contiguous
    ):
        raise TypeError("prompt_token_ids must be a 1-D C-contiguous numpy array of dtype int32")

"""Adapts DeepInfer's ``LLMEngine`` to the driver's ``Engine`` protocol.

DeepInfer's ``step()`` returns raw ``uint64`` pointers that die at the next ``step()``. This adapter copies every
output into an ``EngineOutput`` with the static ``RequestOutput.get_*`` getters before returning, so nothing above
it ever holds a pointer. It also covers three gaps of the engine: requests still compiling a grammar are invisible
to ``abort_request`` (they are aborted again once they surface), ``finished_payload`` grows without bound unless
DeepInfer's stats logger runs (it is trimmed here), and scheduler statistics are only reachable from the engine
thread (they are snapshotted once per step for ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import compress
from typing import Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from backends.engine.protocol import EngineOutput, MetricSample
from backends.errors import UpstreamError

WAITING = 0
FINISHED = 3
"""``SequenceStatus`` values: ``WAITING`` and the first finished status (``FINISHED_STOPPED``)."""

_INT32 = np.iinfo(np.int32)


class EngineStatistics(NamedTuple):
    """Scheduler counters read on the engine thread after each step (the C++ scheduler is not thread-safe)."""

    running: int = 0
    waiting: int = 0  # queued, prompted, or compiling a grammar
    kv_cache_usage: float = 0.0
    preempted: int = 0
    aborted: int = 0


class DeepInferEngine:
    """DeepInfer's ``LLMEngine`` behind the ``Engine`` protocol; every call comes from the driver thread."""

    def __init__(
        self,
        llm_engine: Any,
        request_output: Any,
        *,
        version: str,
        batch_invariant: bool,
        speculative_tokens: int,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.llm_engine = llm_engine
        tokenizer = getattr(llm_engine.tokenizer, "backend_tokenizer", None)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError("DeepInfer loaded a tokenizer without a fast backend (tokenizer.json is required)")
        self.tokenizer: Tokenizer = tokenizer
        self.max_model_len: int = llm_engine.model_config.max_model_len
        self.vocab_size: int = llm_engine.model_config.get_vocab_size()
        self.max_num_seqs: int = llm_engine.scheduler_config.max_num_seqs  # a DP worker's fallback load figure
        self.fingerprint = f"fp_deepinfer-{version}-batch_invariant_{'on' if batch_invariant else 'off'}"
        self.has_unfinished_requests: Callable[[], bool] = llm_engine.has_unfinished_requests
        self.get_num_unfinished_requests: Callable[[], int] = llm_engine.get_num_unfinished_requests
        self._engine_step: Callable[[], np.ndarray] = llm_engine.step
        self._engine_flush: Callable[[], np.ndarray] = llm_engine.flush_inflight_reqs
        self._on_close = on_close
        r = request_output
        self._fields = (
            r.get_request_id,
            r.get_token_id,
            r.get_finished,
            r.get_finish_reason,
            r.get_num_output_tokens,
            r.get_prompt_len,
            r.get_token_logprobs,
            r.get_top_logprobs,
            r.get_top_token_ids,
        )
        self._get_prompt_logprobs = r.get_prompt_logprobs
        self._scoring: set[str] = set()  # requests that asked for prompt logprobs and have not had them yet
        self._cached: dict[str, int] = {}  # requests added with a computed prefix, until their first output
        self.prompt_tokens = 0
        """Prompt tokens of the requests added (what a prefix cache was asked about)."""
        self.cached_tokens = 0
        """Of those, the tokens the engine already held computed when the request was added."""
        self._get_draft_tok = r.get_draft_tok
        self._get_accept_tok = r.get_accept_tok
        self._speculative = speculative_tokens > 0
        self._trim_payload = not llm_engine.log_stats
        self._total_blocks = max(1, int(llm_engine.cache_config.num_gpu_blocks) - 1)  # one block is reserved
        self._compiling: dict[str, Any] = {}  # structured-output requests that may not be in the scheduler yet
        self._reabort: dict[str, Any] = {}  # aborted while compiling: abort again once they surface
        self.statistics = EngineStatistics()
        self.drafts = 0
        """Decode steps of a request that verified draft tokens (DSpark / MTP)."""
        self.draft_tokens = 0
        self.accepted_tokens = 0

    # ---- Engine protocol ----------------------------------------------------------------------------------------

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> object | None:
        """Adds a request (with its images' ``multi_modal_data``, if any); ``None`` back means DeepInfer dropped it (a
        token id out of range)."""
        prompt = _int32_prompt(prompt_token_ids)
        structured = sampling_params is not None and sampling_params.get("so_args") is not None
        try:
            sequence = self.llm_engine.add_request(
                user_id=user_id,
                request_id=request_id,
                sampling_params=sampling_params,
                prompt_token_ids=prompt,
                multi_modal_data=multi_modal_data,
            )
        except RuntimeError as exc:
            if not structured:
                raise
            # The grammar compiler starts on first use and refuses when this GPU's CPU share is too small: a
            # failure of this request's feature, not of the engine every other request runs on.
            raise UpstreamError(f"structured outputs are unavailable on this engine: {exc}") from exc
        if sequence is None:
            return None
        self.prompt_tokens += len(prompt)
        # The engine's own per-request count: the prompt tokens whose KV this sequence already holds (its
        # ``cache.num_tokens``), read before any step prefills it. DeepInfer 0.1.0 gives a new sequence none: only a
        # scheduler fork (``fork_seq``, unused from Python) starts one with a computed prefix.
        cached = int(sequence.num_cached_tokens)
        if cached:
            self._cached[request_id] = cached
            self.cached_tokens += cached
        if structured:
            self._compiling[request_id] = sequence
        if sampling_params is not None and sampling_params.get("prompt_logprobs"):
            self._scoring.add(request_id)
        return sequence

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        result = self.llm_engine.abort_request(ids)
        if self._scoring:
            self._scoring.difference_update(ids)
        if self._cached:
            for rid in ids:
                self._cached.pop(rid, None)
        if self._compiling:
            for rid in ids:
                sequence = self._compiling.pop(rid, None)
                if sequence is not None and int(sequence.status) < FINISHED:
                    self._reabort[rid] = sequence  # maybe still compiling, where abort_request cannot see it
        return result

    def step(self) -> list[EngineOutput]:
        outputs = self._read(self._engine_step())
        self._after_step()
        return outputs

    def flush_inflight_reqs(self) -> list[EngineOutput]:
        outputs = self._read(self._engine_flush())
        self._after_step()
        return outputs

    def close(self) -> None:
        try:
            self.llm_engine.close()
        finally:
            if self._on_close is not None:
                self._on_close()

    # ---- metrics --------------------------------------------------------------------------------------------------

    def metric_samples(self) -> list[MetricSample]:
        """Engine statistics for ``/metrics``: plain numbers the engine thread updated at its last step."""
        stats = self.statistics
        samples = [
            MetricSample("engine_running_requests", "gauge", "Requests running in the engine.", stats.running),
            MetricSample(
                "engine_waiting_requests",
                "gauge",
                "Requests waiting in the engine (queued, or compiling a grammar).",
                stats.waiting,
            ),
            MetricSample(
                "engine_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.", stats.kv_cache_usage
            ),
            MetricSample(
                "engine_preempted_requests",
                "counter",
                "Requests preempted under KV-cache pressure (stopped with insufficient_system_resource, or "
                "recomputed when stop_preempted_request is off).",
                stats.preempted,
            ),
            MetricSample(
                "engine_prefix_cache_queried_tokens",
                "counter",
                "Prompt tokens of the requests added to the engine.",
                self.prompt_tokens,
            ),
            MetricSample(
                "engine_prefix_cache_hit_tokens",
                "counter",
                "Of those, the tokens the engine already held computed (its per-sequence num_cached_tokens).",
                self.cached_tokens,
            ),
            MetricSample(
                "engine_aborted_requests",
                "counter",
                "Requests aborted inside the engine (client gone, stop string, shutdown).",
                stats.aborted,
            ),
        ]
        if self._speculative:
            samples += [
                MetricSample(
                    "engine_spec_decode_drafts",
                    "counter",
                    "Request decode steps that verified draft tokens.",
                    self.drafts,
                ),
                MetricSample("engine_spec_decode_draft_tokens", "counter", "Draft tokens verified.", self.draft_tokens),
                MetricSample(
                    "engine_spec_decode_accepted_tokens", "counter", "Draft tokens accepted.", self.accepted_tokens
                ),
            ]
        return samples

    # ---- engine thread ----------------------------------------------------------------------------------------------

    def _read(self, pointers: np.ndarray) -> list[EngineOutput]:
        """Copies each pointed-to output into a record now: the next ``step()`` frees them."""
        count = len(pointers)
        if not count:
            return []
        ps = pointers.tolist()
        (request_id, token_id, finished, reason, num_output, prompt_len, logprob, top_logprobs, top_ids) = self._fields
        outputs = list(
            map(
                EngineOutput,
                map(request_id, ps),
                map(token_id, ps),
                map(finished, ps),
                map(reason, ps),
                map(num_output, ps),
                map(prompt_len, ps),
                map(logprob, ps),
                map(top_logprobs, ps),
                map(top_ids, ps),
            )
        )
        if self._scoring:
            self._read_prompt_logprobs(ps, outputs)
        if self._cached:
            self._attach_cached_tokens(outputs)
        if self._speculative:
            # draft_tok / accept_tok are set on a request's last output of the step (verified + 1, accepted + 1)
            # and are 0 on its other outputs, so summing over every output counts each verification once.
            drafted = np.fromiter(map(self._get_draft_tok, ps), dtype=np.int64, count=count)
            verified = drafted > 1
            steps = int(verified.sum())
            if steps:
                self.drafts += steps
                self.draft_tokens += int(drafted[verified].sum()) - steps
                self.accepted_tokens += sum(map(self._get_accept_tok, compress(ps, verified.tolist()))) - steps
        return outputs

    def _read_prompt_logprobs(self, pointers: list[int], outputs: list[EngineOutput]) -> None:
        """Prompt logprobs ride on a scoring request's first output (the prompt step's); copy them with it."""
        scoring = self._scoring
        for position, out in enumerate(outputs):
            if out.request_id in scoring:
                scoring.discard(out.request_id)
                values = self._get_prompt_logprobs(pointers[position])
                outputs[position] = out._replace(prompt_logprobs=list(values))

    def _attach_cached_tokens(self, outputs: list[EngineOutput]) -> None:
        """A request's cached prompt tokens ride on its first output, as the driver above expects them."""
        cached = self._cached
        for position, out in enumerate(outputs):
            hit = cached.pop(out.request_id, None)
            if hit is not None:
                outputs[position] = out._replace(num_cached_tokens=hit)
                if not cached:
                    return

    def _after_step(self) -> None:
        """Per-step housekeeping: a few O(1) engine calls, plus a walk over grammar requests while any exist."""
        engine = self.llm_engine
        if self._compiling or self._reabort:
            self._settle_grammar_requests()
        if self._trim_payload:
            payload = engine.finished_payload
            if payload:
                payload.clear()  # only DeepInfer's stats logger trims it; with the logger off it would grow forever
        scheduler = engine.scheduler
        running = scheduler.get_sum_prompt_len_running()[0]
        self.statistics = EngineStatistics(
            running,
            max(0, engine.get_num_unfinished_requests() - running),
            (self._total_blocks - scheduler.get_num_free_gpu_blocks()) / self._total_blocks,
            scheduler.get_num_preempted_seqs(),
            scheduler.get_num_aborted_seqs(),
        )

    def _settle_grammar_requests(self) -> None:
        abort = self.llm_engine.abort_request
        for rid, sequence in list(self._reabort.items()):
            if int(sequence.status) >= FINISHED or abort(rid)[0]:
                del self._reabort[rid]
        for rid, sequence in list(self._compiling.items()):
            if int(sequence.status) != WAITING:  # scheduled or finished: visible to abort_request from now on
                del self._compiling[rid]


def _int32_prompt(prompt_token_ids: Any) -> np.ndarray:
    """DeepInfer's ``Sequence`` takes exactly a 1-D C-contiguous ``np.int32`` array (pybind ``noconvert``)."""
    array = np.asarray(prompt_token_ids)
    if array.ndim != 1:
        raise ValueError("prompt token ids must be a flat list")
    if array.dtype != np.int32:
        if array.size and (array.dtype.kind not in "iu" or array.min() < _INT32.min or array.max() > _INT32.max):
            raise ValueError("prompt token ids must be integers in the int32 range")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)

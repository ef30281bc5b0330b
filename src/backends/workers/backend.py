"""A backend over N data-parallel engine ranks in worker processes.

It is ``EngineBackend`` (prompt encoding, ``max_tokens``, per-choice detokenizing, stop strings, logprobs on the
event loop) with its driver swapped for a ``DataParallelDriver``: the request path is the same code whether the
engine runs in process or in N workers. What it adds: readiness that reports degraded states (``3/4 ranks up``)
and per-rank metric families (label ``rank``), whose numbers are the ranks' own (what each rank reports of itself,
for every dispatcher), so every front end in front of the same ranks shows the same figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from tokenizers import Tokenizer

from backends.engine.backend import ChatTemplate, EngineBackend
from backends.engine.prompts import DEFAULT_PREPARE_THREADS, ImageResolver
from backends.engine.protocol import Engine
from backends.workers.driver import DataParallelDriver, WorkerPlan

_KV_SAMPLE = "engine_kv_cache_usage_ratio"
_DRAFT_TOKENS = "engine_spec_decode_draft_tokens"
_ACCEPTED_TOKENS = "engine_spec_decode_accepted_tokens"


class RankReport(NamedTuple):
    """One rank as this front end sees it, for readiness aggregations and operators (``DataParallelBackend.ranks``)."""

    rank: int
    state: Literal["down", "starting", "up"]
    reason: str  # why it does not serve ('' when up): the engine's error, its restarts, its backoff
    restarts: int  # as its launcher counts them
    backoff_seconds: float  # until it is started again (0 while up or building)
    pid: int | None


def _no_local_engine() -> Engine:
    raise RuntimeError("a data-parallel backend runs its engines in worker processes")


class DataParallelBackend(EngineBackend):
    """``EngineBackend`` whose engines are ``plan.size`` worker processes."""

    driver: DataParallelDriver  # type: ignore[assignment]

    def __init__(
        self,
        name: str,
        kind: str,
        plan: WorkerPlan,
        load_tokenizer: Callable[[], Tokenizer],
        chat_template: ChatTemplate,
        *,
        prepare_threads: int = DEFAULT_PREPARE_THREADS,
        images: ImageResolver | None = None,
    ) -> None:
        super().__init__(name, kind, _no_local_engine, chat_template, prepare_threads=prepare_threads, images=images)
        self.driver = DataParallelDriver(name, plan, load_tokenizer)

    def readiness(self) -> tuple[bool, str]:
        ready, reason = super().readiness()
        if ready:
            return True, self.driver.describe()
        if reason == "starting" and self.driver.ranks:
            return False, f"starting: {self.driver.describe()}"
        return ready, reason

    def ranks(self) -> list[RankReport]:
        """Every rank's state, restarts and backoff: what ``readiness()`` says in words."""
        now = time.monotonic()
        return [
            RankReport(
                r.index,
                r.state,
                "" if r.state == "up" else r.explain(now),
                r.restarts,
                r.backoff(now),
                r.pid,
            )
            for r in self.driver.ranks
        ]

    def max_model_len(self) -> int | None:
        """The ranks' context window, once one of them has reported it."""
        engine = self.driver.engine
        return engine.max_model_len or None if engine is not None else None

    def metric_families(self) -> list[Metric]:
        """Per-rank statistics (labels: backend, rank), read at scrape time from what the ranks last reported of
        themselves; a rank that is down has only ``up`` and ``restarts`` until it reports again."""
        labels = ["backend", "rank"]
        up = GaugeMetricFamily("gateway_dp_rank_up", "1 while the data-parallel rank serves.", labels=labels)
        in_flight = GaugeMetricFamily("gateway_dp_rank_requests", "Requests the rank holds.", labels=labels)
        queued = GaugeMetricFamily(
            "gateway_dp_rank_queued_prompt_tokens",
            "Prompt tokens sent to the rank and not yet prefilled.",
            labels=labels,
        )
        dispatched = CounterMetricFamily(
            "gateway_dp_rank_dispatched_requests", "Engine requests sent to the rank.", labels=labels
        )
        steps = CounterMetricFamily("gateway_dp_rank_steps", "Engine steps of the rank.", labels=labels)
        rate = GaugeMetricFamily(
            "gateway_dp_rank_steps_per_second", "Engine steps per second (last second).", labels=labels
        )
        tokens = CounterMetricFamily("gateway_dp_rank_output_tokens", "Tokens the rank produced.", labels=labels)
        kv = GaugeMetricFamily(
            "gateway_dp_rank_kv_usage_ratio",
            "KV-cache usage of the rank (engines without a KV figure: running requests / max_num_seqs).",
            labels=labels,
        )
        acceptance = GaugeMetricFamily(
            "gateway_dp_rank_spec_decode_acceptance_ratio",
            "Draft tokens accepted / verified since the rank started (speculative decoding).",
            labels=labels,
        )
        restarts = CounterMetricFamily("gateway_dp_rank_restarts", "Times the rank was restarted.", labels=labels)
        backoff = GaugeMetricFamily(
            "gateway_dp_rank_backoff_seconds",
            "Seconds until the rank is started again after a failure (0 while it serves or builds its engine).",
            labels=labels,
        )
        starting = GaugeMetricFamily(
            "gateway_dp_rank_starting", "1 while the rank waits out its backoff or builds its engine.", labels=labels
        )
        engine_families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        now = time.monotonic()
        for rank in self.driver.ranks:
            key = [self.name, str(rank.index)]
            up.add_metric(key, 1.0 if rank.state == "up" else 0.0)
            starting.add_metric(key, 1.0 if rank.state == "starting" else 0.0)
            restarts.add_metric(key, rank.restarts)
            backoff.add_metric(key, rank.backoff(now))
            stats = rank.stats
            if stats is None:
                continue
            in_flight.add_metric(key, stats.requests)
            queued.add_metric(key, stats.queued_prompt_tokens)
            dispatched.add_metric(key, stats.dispatched)
            steps.add_metric(key, stats.steps)
            tokens.add_metric(key, stats.tokens)
            rate.add_metric(key, stats.steps_per_second)
            samples: dict[str, Sequence[Any]] = {s[0]: s for s in rank.samples}
            kv_sample = samples.get(_KV_SAMPLE)
            kv.add_metric(key, float(kv_sample[3]) if kv_sample is not None else stats.kv_usage)
            drafts, accepted = samples.get(_DRAFT_TOKENS), samples.get(_ACCEPTED_TOKENS)
            if drafts is not None and accepted is not None and drafts[3]:
                acceptance.add_metric(key, accepted[3] / drafts[3])
            for name, kind, documentation, value in samples.values():
                family = engine_families.get(name)
                if family is None:
                    family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    family = engine_families[name] = family_type(
                        f"gateway_dp_rank_{name}", documentation, labels=labels
                    )
                family.add_metric(key, value)
        return [
            up,
            starting,
            backoff,
            in_flight,
            queued,
            dispatched,
            steps,
            rate,
            tokens,
            kv,
            acceptance,
            restarts,
            *engine_families.values(),
        ]

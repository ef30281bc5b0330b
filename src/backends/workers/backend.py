"""A backend over N data-parallel engine ranks in worker processes.

It is the engine backend's request path (``DrivenEngines``: prompt encoding, ``max_tokens``, per-choice
detokenizing, stop strings, logprobs on the event loop) over a ``DataParallelDriver``: the request path is the same
code whether the engine runs in process or in N workers. What it adds: readiness that reports degraded states
(``3/4 ranks up``) and per-rank metric families (label ``rank``), whose numbers are the ranks' own (what each rank
reports of itself, for every dispatcher), so every front end in front of the same ranks shows the same figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from tokenizers import Tokenizer

from backends.engine.backend import ChatTemplate, DrivenEngines
from backends.engine.prompts import DEFAULT_PREPARE_THREADS, ImageResolver
from backends.workers.driver import DataParallelDriver
from backends.workers.launch import WorkerPlan
from backends.workers.ranks import RankState

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


class DataParallelBackend(DrivenEngines[DataParallelDriver]):
    """The engine backend's request path over ``plan.size`` engines in worker processes."""

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
        driver = DataParallelDriver(name, plan, load_tokenizer)
        super().__init__(name, kind, driver, chat_template, prepare_threads=prepare_threads, images=images)

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
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            key: kind(f"gateway_dp_rank_{key}", documentation, labels=_RANK_LABELS)
            for key, kind, documentation in _RANK_FAMILIES
        }
        engine_families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        now = time.monotonic()
        for rank in self.driver.ranks:
            _add_rank(families, engine_families, [self.name, str(rank.index)], rank, now)
        return [*families.values(), *engine_families.values()]


_RANK_LABELS = ["backend", "rank"]
_RANK_FAMILIES: tuple[tuple[str, type[CounterMetricFamily] | type[GaugeMetricFamily], str], ...] = (
    ("up", GaugeMetricFamily, "1 while the data-parallel rank serves."),
    ("starting", GaugeMetricFamily, "1 while the rank waits out its backoff or builds its engine."),
    (
        "backoff_seconds",
        GaugeMetricFamily,
        "Seconds until the rank is started again after a failure (0 while it serves or builds its engine).",
    ),
    ("requests", GaugeMetricFamily, "Requests the rank holds."),
    ("queued_prompt_tokens", GaugeMetricFamily, "Prompt tokens sent to the rank and not yet prefilled."),
    ("dispatched_requests", CounterMetricFamily, "Engine requests sent to the rank."),
    ("steps", CounterMetricFamily, "Engine steps of the rank."),
    ("steps_per_second", GaugeMetricFamily, "Engine steps per second (last second)."),
    ("output_tokens", CounterMetricFamily, "Tokens the rank produced."),
    (
        "kv_usage_ratio",
        GaugeMetricFamily,
        "KV-cache usage of the rank (engines without a KV figure: running requests / max_num_seqs).",
    ),
    (
        "spec_decode_acceptance_ratio",
        GaugeMetricFamily,
        "Draft tokens accepted / verified since the rank started (speculative decoding).",
    ),
    ("restarts", CounterMetricFamily, "Times the rank was restarted."),
)
"""The per-rank families (``gateway_dp_rank_<key>``), in the order a scrape lists them."""


def _add_rank(
    families: dict[str, CounterMetricFamily | GaugeMetricFamily],
    engine_families: dict[str, CounterMetricFamily | GaugeMetricFamily],
    key: list[str],
    rank: RankState,
    now: float,
) -> None:
    """One rank's samples: its state always, its statistics and engine samples once it has reported them."""
    families["up"].add_metric(key, 1.0 if rank.state == "up" else 0.0)
    families["starting"].add_metric(key, 1.0 if rank.state == "starting" else 0.0)
    families["restarts"].add_metric(key, rank.restarts)
    families["backoff_seconds"].add_metric(key, rank.backoff(now))
    stats = rank.stats
    if stats is None:
        return
    families["requests"].add_metric(key, stats.requests)
    families["queued_prompt_tokens"].add_metric(key, stats.queued_prompt_tokens)
    families["dispatched_requests"].add_metric(key, stats.dispatched)
    families["steps"].add_metric(key, stats.steps)
    families["output_tokens"].add_metric(key, stats.tokens)
    families["steps_per_second"].add_metric(key, stats.steps_per_second)
    samples: dict[str, Sequence[Any]] = {s[0]: s for s in rank.samples}
    kv_sample = samples.get(_KV_SAMPLE)
    families["kv_usage_ratio"].add_metric(key, float(kv_sample[3]) if kv_sample is not None else stats.kv_usage)
    drafts, accepted = samples.get(_DRAFT_TOKENS), samples.get(_ACCEPTED_TOKENS)
    if drafts is not None and accepted is not None and drafts[3]:
        families["spec_decode_acceptance_ratio"].add_metric(key, accepted[3] / drafts[3])
    for name, kind, documentation, value in samples.values():
        family = engine_families.get(name)
        if family is None:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = engine_families[name] = family_type(f"gateway_dp_rank_{name}", documentation, labels=_RANK_LABELS)
        family.add_metric(key, value)

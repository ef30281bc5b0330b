"""Prometheus metrics, named like vLLM's so dashboards carry over, labelled by model and backend."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from backends.interface import DrivenBackend, MetricFamiliesBackend, MetricSamplesBackend
from gateway.capabilities import GatedBackend, capability

if TYPE_CHECKING:
    from backends.interface import Backend, Usage
    from gateway.shared_store import SharedStateStore

TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Set by the front-end supervisor (``server.runtime.workers`` > 1) before it starts the processes: prometheus-client
then keeps counters, histograms and gauges in files there, one per process, and a scrape sums them."""


class AppRegistry(CollectorRegistry):
    """The app's registry; remembers the collectors that compute their families at scrape time (engine and
    routing state), as opposed to counters, gauges and histograms."""

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.computed.append(collector)


class _ComputedFamilies(Collector):
    def __init__(self, registry: AppRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for collector in self._registry.computed:
            yield from collector.collect()


def exposition(registry: AppRegistry) -> bytes:
    """The text ``/metrics`` serves. With several front-end processes, request metrics are summed over all of
    them (whichever process answers the scrape), and the families computed at scrape time (backend, engine,
    routing state) are this process's own."""
    directory = os.environ.get(MULTIPROCESS_DIR_ENV)
    if not directory:
        return generate_latest(registry)
    combined = CollectorRegistry()
    MultiProcessCollector(combined, path=directory)
    combined.register(_ComputedFamilies(registry))
    return generate_latest(combined)


class GatewayMetrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = AppRegistry()
        labels = ("model", "backend")
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "Finished requests by HTTP status.", (*labels, "status"), registry=r
        )
        self.tokenizer_requests = Counter(
            "gateway_tokenizer_requests",
            "Requests handled by /tokenize, /detokenize and /tokenizer_info, by HTTP status.",
            ("endpoint", "status"),
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "gateway_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gateway_e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.prompt_cache_hit_tokens = Counter(
            "gateway_prompt_cache_hit_tokens",
            "Of the prompt tokens, those the backend found in its prefix cache (as its usage reported them).",
            labels,
            registry=r,
        )
        self.generation_tokens = Counter("gateway_generation_tokens", "Tokens generated.", labels, registry=r)
        self.in_flight = Gauge(
            "gateway_requests_in_flight", "Requests being served.", labels, registry=r, multiprocess_mode="livesum"
        )
        self.stalls = Counter(
            "gateway_stream_stalls",
            "Requests stopped because their client did not take its output (buffer_full: more than "
            "server.streams.stream_buffer_tokens waited; send_timeout: no data accepted for "
            "server.streams.stall_timeout).",
            (*labels, "reason"),
            registry=r,
        )
        self.errors = Counter(
            "gateway_request_errors", "Requests that ended in an error, by error code.", (*labels, "code"), registry=r
        )
        self._series: dict[tuple[str, str], _Series] = {}

    def watch_gc(self) -> None:
        """Counts collections and their pauses per generation, so GC tuning is measured, not assumed."""
        pauses = Counter(
            "gateway_gc_pause_seconds", "Time spent in garbage collection.", ("generation",), registry=self.registry
        )
        collections = Counter("gateway_gc_collections", "Garbage collections.", ("generation",), registry=self.registry)
        children = {g: (pauses.labels(str(g)), collections.labels(str(g))) for g in range(3)}
        started = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pause, count = children[info["generation"]]
                pause.inc(time.perf_counter() - started[0])
                count.inc()

        gc.callbacks.append(on_gc)
        self._gc_callback = on_gc

    def close(self) -> None:
        callback = getattr(self, "_gc_callback", None)
        if callback is not None and callback in gc.callbacks:
            gc.callbacks.remove(callback)

    def watch_backends(self, backends: Iterable[Backend]) -> None:
        self.registry.register(_BackendCollector(list(backends)))

    def watch_state_store(self, store: SharedStateStore) -> None:
        self.registry.register(_StateStoreCollector(store))

    def observer(self, model: str, backend: str, log: dict[str, object]) -> RequestObserver:
        return RequestObserver(self, model, backend, log)

    def series(self, model: str, backend: str) -> _Series:
        """The request metrics' children for one (model, backend), looked up once (models and backends come from
        the config, so the cache is as small as the label space)."""
        found = self._series.get((model, backend))
        if found is None:
            found = self._series[(model, backend)] = _Series(self, model, backend)
        return found

    def count_unrouted(self, status: int, code: str | None) -> None:
        """A request that ended before any backend took it: labelled with empty model and backend (the client's
        model name is not a label, so junk names cannot blow up the series count)."""
        self.requests.labels("", "", str(status)).inc()
        if status >= 400:
            self.errors.labels("", "", code or str(status)).inc()


class _Series:
    """One (model, backend)'s children of the request metrics; by status, error code and stall reason on demand."""

    __slots__ = (
        "_by_label",
        "_metrics",
        "e2e",
        "generation_tokens",
        "in_flight",
        "labels",
        "prompt_cache_hit_tokens",
        "prompt_tokens",
        "tpot",
        "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, model: str, backend: str) -> None:
        self._metrics = metrics
        self.labels = labels = (model, backend)
        self.in_flight = metrics.in_flight.labels(*labels)
        self.e2e = metrics.e2e.labels(*labels)
        self.ttft = metrics.ttft.labels(*labels)
        self.tpot = metrics.tpot.labels(*labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self.prompt_cache_hit_tokens = metrics.prompt_cache_hit_tokens.labels(*labels)
        self.generation_tokens = metrics.generation_tokens.labels(*labels)
        self._by_label: dict[tuple[Counter, str], Any] = {}

    def requests(self, status: int) -> Any:
        return self._child(self._metrics.requests, str(status))

    def errors(self, code: str) -> Any:
        return self._child(self._metrics.errors, code)

    def stalls(self, reason: str) -> Any:
        return self._child(self._metrics.stalls, reason)

    def _child(self, counter: Counter, label: str) -> Any:
        """``counter``'s child for this series and one more label, looked up once."""
        child = self._by_label.get((counter, label))
        if child is None:
            child = self._by_label[(counter, label)] = counter.labels(*self.labels, label)
        return child


class RequestCost(NamedTuple):
    """What a request consumed, as its observer saw it end: what a key's token budget is charged from."""

    status: int
    usage: Usage | None
    """The backend's own count, when it reported one (it comes last: a request cut short has none)."""
    output_tokens: int
    """Output tokens the gateway took from the backend for the client (and sent, when streaming)."""
    output_started: bool
    prompt_tokens: int = 0
    """Prompt tokens the backend said it processed (``Delta.prompt_tokens``); 0 when it did not say."""
    reached_backend: bool = True
    """False when admission never handed the request to a backend (shed, timed out or left while queued)."""


class RequestObserver:
    """Times one request and records it once, whatever way it ends."""

    __slots__ = (
        "_done",
        "_metrics",
        "_series",
        "backend",
        "first_token_at",
        "log",
        "model",
        "on_finish",
        "output_tokens",
        "prompt_tokens",
        "started",
    )

    def __init__(self, metrics: GatewayMetrics, model: str, backend: str, log: dict[str, object]) -> None:
        self._metrics = metrics
        self.model = model
        self.backend = backend
        self.log = log
        self._series = metrics.series(model, backend)
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.output_tokens = 0
        self.prompt_tokens = 0
        self._done = False
        self.on_finish: Callable[[RequestCost], None] | None = None
        """Called once with what the request consumed (per-key token budgets are charged here)."""
        log["model"] = model
        log["backend"] = backend
        self._series.in_flight.inc()

    def rebind(self, backend: str) -> None:
        """A fallback target took the request over before its first token: label it by the one serving it."""
        if self._done or backend == self.backend:
            return
        self._series.in_flight.dec()
        self.backend = backend
        self._series = self._metrics.series(self.model, backend)
        self.log["backend"] = backend
        self._series.in_flight.inc()

    def stalled(self, reason: str) -> None:
        """The client did not keep up and its request was stopped (``buffer_full`` or ``send_timeout``)."""
        if not self._done:
            self._series.stalls(reason).inc()

    def output(self, tokens: int, prompt_tokens: int = 0) -> None:
        """A delta of ``tokens`` output tokens goes to the client (the first one times the first token), with the
        prompt tokens the backend processed when it is the first delta of a backend stream."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_tokens += tokens
        self.prompt_tokens += prompt_tokens

    def cost(self, status: int, usage: Usage | None) -> RequestCost:
        admission = self.log.get("admission")
        return RequestCost(
            status,
            usage,
            self.output_tokens,
            self.first_token_at is not None,
            self.prompt_tokens,
            reached_backend=admission is None or admission == "admitted",
        )

    def finish(self, status: int, usage: Usage | None = None, code: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        prompt_tokens, completion_tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        series = self._series
        now = time.perf_counter()
        series.in_flight.dec()
        series.requests(status).inc()
        e2e = now - self.started
        series.e2e.observe(e2e)
        if self.on_finish is not None:
            self.on_finish(self.cost(status, usage))
        self.log["status"] = status
        self.log["e2e_ms"] = round(e2e * 1000, 3)
        if code is not None or status >= 400:
            series.errors(code or str(status)).inc()
            self.log["error_code"] = code
        if prompt_tokens:
            series.prompt_tokens.inc(prompt_tokens)
            self.log["prompt_tokens"] = prompt_tokens
            assert usage is not None
            if usage.cached_tokens:
                series.prompt_cache_hit_tokens.inc(usage.cached_tokens)
            self.log["prompt_cache_hit_tokens"] = usage.cached_tokens
        if completion_tokens:
            series.generation_tokens.inc(completion_tokens)
            self.log["completion_tokens"] = completion_tokens
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.started
            series.ttft.observe(ttft)
            self.log["ttft_ms"] = round(ttft * 1000, 3)
            if completion_tokens > 1:
                series.tpot.observe((now - self.first_token_at) / (completion_tokens - 1))


KV_CACHE_SAMPLE = "engine_kv_cache_usage_ratio"
"""The engine statistic (``metric_samples``) exported again as the inference extension's KV utilization."""


class _BackendCollector(Collector):
    """Reads engine-driver counters at scrape time instead of updating metrics on the engine thread."""

    def __init__(self, backends: list[Backend]) -> None:
        self._backends = backends

    def collect(self) -> Iterable[Metric]:
        yield from _readiness_and_driver_families(self._backends)
        yield from _admission_families(self._backends)
        yield _kv_usage_family(self._backends)
        yield from self._engine_samples()
        yield from self._backend_families()

    def _backend_families(self) -> Iterable[Metric]:
        """Backend-defined metric families with labels of their own (``metric_families()``, e.g. per upstream
        node); families of the same name from several backends are merged into one."""
        merged: dict[str, Metric] = {}
        for backend in self._backends:
            labelled = capability(backend, MetricFamiliesBackend)
            if labelled is None:
                continue
            for family in labelled.metric_families():
                existing = merged.get(family.name)
                if existing is None:
                    merged[family.name] = family
                else:
                    existing.samples.extend(family.samples)
        return merged.values()

    def _engine_samples(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        """Backend-defined statistics: ``metric_samples()`` gives (name, kind, help, value) tuples, exported as
        ``gateway_<name>{backend}``; the gateway needs to know nothing about the engine behind them."""
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for backend in self._backends:
            sampled = capability(backend, MetricSamplesBackend)
            if sampled is None:
                continue
            for name, kind, documentation, value in sampled.metric_samples():
                family = families.get(name)
                if family is None:
                    family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    family = families[name] = family_type(f"gateway_{name}", documentation, labels=["backend"])
                family.add_metric([backend.name], value)
        return families.values()


class _StateStoreCollector(Collector):
    """Whether the shared state store answers; while it does not, budgets are local to each process."""

    def __init__(self, store: SharedStateStore) -> None:
        self._store = store

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        up = GaugeMetricFamily("gateway_state_store_up", "1 while the shared state store answers.")
        up.add_metric([], 1.0 if self._store.up else 0.0)
        failures = CounterMetricFamily("gateway_state_store_failures", "Calls to the shared state store that failed.")
        failures.add_metric([], self._store.failures)
        yield from (up, failures)


def _readiness_and_driver_families(backends: list[Backend]) -> list[Metric]:
    """Each backend's readiness and, for engine-driven backends, the driver's step, token and time counters."""
    ready = GaugeMetricFamily("gateway_backend_ready", "1 when the backend can take requests.", labels=["backend"])
    steps = CounterMetricFamily("gateway_engine_steps", "Engine steps driven.", labels=["backend"])
    tokens = CounterMetricFamily("gateway_engine_output_tokens", "Tokens read from the engine.", labels=["backend"])
    busy = CounterMetricFamily(
        "gateway_engine_busy_seconds", "Engine-thread time not spent waiting for work.", labels=["backend"]
    )
    inside = CounterMetricFamily(
        "gateway_engine_step_seconds", "Engine-thread time inside step() and flush.", labels=["backend"]
    )
    paced = CounterMetricFamily(
        "gateway_engine_backpressure_seconds",
        "Engine-thread time waiting for the event loop to take earlier outputs (the loop is the bottleneck).",
        labels=["backend"],
    )
    running = GaugeMetricFamily(
        "gateway_engine_requests", "Requests registered with the engine driver.", labels=["backend"]
    )
    for backend in backends:
        ready.add_metric([backend.name], 1.0 if backend.readiness()[0] else 0.0)
        driven = capability(backend, DrivenBackend)
        if driven is None:
            continue
        stats = driven.driver.stats
        steps.add_metric([backend.name], stats.steps)
        tokens.add_metric([backend.name], stats.tokens)
        paced.add_metric([backend.name], stats.backpressure_seconds)
        busy.add_metric([backend.name], stats.busy_seconds)
        inside.add_metric([backend.name], stats.engine_seconds)
        running.add_metric([backend.name], driven.driver.in_flight)
    return [ready, steps, tokens, busy, inside, paced, running]


def _admission_families(backends: list[Backend]) -> list[Metric]:
    """Admission slots and queues of gated backends, under the gateway's names and then under the names of the
    Gateway API Inference Extension's model-server protocol (vLLM's), for an endpoint picker or KEDA: README,
    Flow control."""
    admitted = GaugeMetricFamily(
        "gateway_admission_in_flight", "Requests holding an admission slot.", labels=["backend"]
    )
    queued = GaugeMetricFamily("gateway_admission_queued", "Requests waiting for a slot.", labels=["backend"])
    rejected = CounterMetricFamily(
        "gateway_admission_rejected", "Requests refused with 503 (queue full or wait too long).", labels=["backend"]
    )
    depth = GaugeMetricFamily(
        "gateway_admission_queue_depth",
        "Requests waiting for a slot, by service tier and API key.",
        labels=["backend", "tier", "key"],
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "Requests waiting for a slot (TotalQueuedRequests).", labels=["backend"]
    )
    running_slots = GaugeMetricFamily(
        "vllm:num_requests_running", "Requests holding a slot (TotalRunningRequests).", labels=["backend"]
    )
    for backend in backends:
        if not isinstance(backend, GatedBackend):
            continue
        gate = backend.gate
        admitted.add_metric([backend.name], gate.in_flight)
        queued.add_metric([backend.name], gate.queued)
        rejected.add_metric([backend.name], gate.rejected)
        waiting.add_metric([backend.name], gate.queued)
        running_slots.add_metric([backend.name], gate.in_flight)
        for tier, key, count in gate.depths():
            depth.add_metric([backend.name, tier, key], count)
    return [admitted, queued, rejected, depth, waiting, running_slots]


def _kv_usage_family(backends: list[Backend]) -> Metric:
    """The engines' KV-cache usage under the inference extension's name (KVCacheUtilization)."""
    kv_usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use, 1 = full (KVCacheUtilization).",
        labels=["backend"],
    )
    for backend in backends:
        sampled = capability(backend, MetricSamplesBackend)
        if sampled is None:
            continue
        for name, _, _, value in sampled.metric_samples():
            if name == KV_CACHE_SAMPLE:
                kv_usage.add_metric([backend.name], value)
    return kv_usage

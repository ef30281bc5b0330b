"""Prometheus metrics of routing, fallbacks, circuit breakers and shadow comparisons.

Counters are updated once per request (never per token); circuit states and shadow concurrency are read at
scrape time from the router's own state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from gateway.routing.breaker import STATE_VALUES

if TYPE_CHECKING:
    from gateway.routing.shadow import ShadowMirror
    from gateway.routing.targets import Target

PAIR = ("model", "primary", "shadow")


class RoutingMetrics:
    """The routing metrics of one app, in the app's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        target = ("model", "backend")
        self.routed = Counter(
            "gateway_routed_requests",
            "Requests sent to a target, by how it was chosen: the model's policy, pinned, or fallback.",
            (*target, "via"),
            registry=r,
        )
        self.target_failures = Counter(
            "gateway_target_failures",
            "Target failures that count toward its circuit breaker, by stage (before_first_event, mid_stream).",
            (*target, "stage"),
            registry=r,
        )
        self.shadow_requests = Counter(
            "gateway_shadow_requests",
            "Mirrored requests by outcome: compared, shadow_failed, primary_failed, dropped (at the concurrency "
            "cap), unavailable (shadow not ready), cancelled (shutdown).",
            (*PAIR, "outcome"),
            registry=r,
        )
        self.shadow_comparisons = Counter(
            "gateway_shadow_comparisons",
            "Primary vs shadow answers compared by aspect (finish_reason, completion_tokens, and text for greedy "
            "requests) and result (match, mismatch).",
            (*PAIR, "aspect", "result", "greedy"),
            registry=r,
        )
        self.shadow_ttft = Histogram(
            "gateway_shadow_time_to_first_token_seconds",
            "Time to first token of compared requests, on each side (primary, shadow).",
            (*PAIR, "side"),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.shadow_tpot = Histogram(
            "gateway_shadow_time_per_output_token_seconds",
            "Mean time per output token after the first of compared requests, on each side.",
            (*PAIR, "side"),
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.shadow_tokens = Counter(
            "gateway_shadow_completion_tokens",
            "Completion tokens of compared requests, on each side.",
            (*PAIR, "side"),
            registry=r,
        )

    def watch(self, targets: Callable[[], Iterable[Target]], shadows: Callable[[], Iterable[ShadowMirror]]) -> None:
        self.registry.register(_RoutingCollector(targets, shadows))


class _RoutingCollector(Collector):
    """Circuit state per target and shadow concurrency, read when Prometheus scrapes."""

    def __init__(self, targets: Callable[[], Iterable[Target]], shadows: Callable[[], Iterable[ShadowMirror]]) -> None:
        self._targets = targets
        self._shadows = shadows

    def collect(self) -> Iterable[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "gateway_circuit_state",
            "Circuit breaker state per target: 0 closed, 1 half-open (next request probes), 2 open.",
            labels=["model", "backend"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_target_in_flight",
            "Requests the router has in flight on a backend (all models), client and shadow.",
            labels=["backend", "traffic"],
        )
        seen: set[str] = set()
        for target in self._targets():
            state.add_metric([target.model, target.name], STATE_VALUES[target.breaker.state])
            if target.name not in seen:
                seen.add(target.name)
                in_flight.add_metric([target.name, "client"], target.load.in_flight)
                in_flight.add_metric([target.name, "shadow"], target.load.shadow_in_flight)
        shadow = GaugeMetricFamily(
            "gateway_shadow_requests_in_flight", "Shadow requests running per model.", labels=["model", "shadow"]
        )
        for mirror in self._shadows():
            shadow.add_metric([mirror.model, mirror.name], mirror.active)
        yield from (state, in_flight, shadow)

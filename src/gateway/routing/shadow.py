"""Shadow traffic: mirror a fraction of a model's requests to another backend and compare the two answers.

The client only ever sees the primary: the shadow runs in a background task that nobody awaits, its errors
are logged and counted, never raised. Shadow work is bounded by its own concurrency cap; a request that would
exceed it is dropped (counted), never queued. Comparison happens when the later of the two sides ends, once
per request: TTFT, TPOT, completion tokens, finish reasons, and for greedy requests (temperature 0) whether
the texts are identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.interface import Backend, Delta, Event, EventStream, Finish, GenerateRequest, Usage
from gateway.capabilities import WrappedBackend
from gateway.routing.targets import BackendLoad, LatencyWindow
from gateway.routing.telemetry import RoutingMetrics

if TYPE_CHECKING:
    from gateway.tracing import Tracing

logger = logging.getLogger(__name__)

EventFactory = Callable[[Backend], EventStream[Event]]
OK, FAILED, CANCELLED = "ok", "failed", "cancelled"


class Capture:
    """What one side of a mirrored request produced, observed event by event (only for mirrored requests)."""

    __slots__ = ("ended_at", "finishes", "first_at", "outcome", "started", "texts", "tokens")

    def __init__(self, greedy: bool) -> None:
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.ended_at: float | None = None
        self.tokens = 0
        self.finishes: dict[int, str] = {}
        self.texts: dict[int, list[str]] | None = {} if greedy else None
        self.outcome: str | None = None

    def observe(self, event: Event) -> None:
        if isinstance(event, Delta):
            if self.first_at is None:
                self.first_at = time.perf_counter()
            if self.texts is not None:
                self.texts.setdefault(event.index, []).append(event.text)
        elif isinstance(event, Finish):
            self.finishes[event.index] = event.reason
        elif isinstance(event, Usage):
            self.tokens = event.completion_tokens

    def end(self, outcome: str) -> None:
        self.ended_at = time.perf_counter()
        self.outcome = outcome

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.started

    @property
    def tpot(self) -> float | None:
        if self.first_at is None or self.ended_at is None or self.tokens < 2:
            return None
        return (self.ended_at - self.first_at) / (self.tokens - 1)

    def text(self) -> list[str]:
        return ["".join(parts) for _, parts in sorted((self.texts or {}).items())]


class ShadowPair:
    """The two sides of one mirrored request; the comparison runs when the second one ends."""

    __slots__ = ("greedy", "mirror", "primary", "primary_backend", "settled", "shadow")

    def __init__(self, mirror: ShadowMirror, primary_backend: str, greedy: bool) -> None:
        self.mirror = mirror
        self.settled = False
        self.primary_backend = primary_backend
        self.greedy = greedy
        self.primary = Capture(greedy)
        self.shadow = Capture(greedy)

    def primary_ended(self, outcome: str, backend: str) -> None:
        """Called by the routed stream when the client's request ends, with the backend that served it."""
        self.primary.end(outcome)
        self.primary_backend = backend
        if self.shadow.outcome is not None:
            self.mirror.settle(self)


class ComparisonSummary:
    """Running totals of one (primary, shadow) pair, for the operator endpoint."""

    __slots__ = ("checks", "compared", "greedy", "tpot", "ttft")

    def __init__(self) -> None:
        self.compared = 0
        self.greedy = 0
        self.checks: dict[str, list[int]] = {"finish_reason": [0, 0], "completion_tokens": [0, 0], "text": [0, 0]}
        self.ttft = {"primary": LatencyWindow(), "shadow": LatencyWindow()}
        self.tpot = {"primary": LatencyWindow(), "shadow": LatencyWindow()}

    def describe(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "greedy": self.greedy,
            **{aspect: {"match": m, "mismatch": x} for aspect, (m, x) in self.checks.items()},
            "ttft_ms": {side: w.percentiles_ms() for side, w in self.ttft.items()},
            "tpot_ms": {side: w.percentiles_ms() for side, w in self.tpot.items()},
        }


class ShadowMirror:
    """Mirrors a fraction of one model's requests to its shadow backend."""

    def __init__(
        self,
        model: str,
        backend: Backend,
        load: BackendLoad,
        *,
        fraction: float,
        max_concurrency: int,
        metrics: RoutingMetrics,
        rng: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.model = model
        self._tracing = tracing
        self.backend = backend
        self.name = backend.name
        self.load = load
        self.fraction = fraction
        self.max_concurrency = max_concurrency
        self._metrics = metrics
        self._random = (rng or random.Random()).random
        self.outcomes: dict[str, int] = {}
        self.summaries: dict[str, ComparisonSummary] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def mirror(self, primary: str, request: GenerateRequest | None, factory: EventFactory) -> ShadowPair | None:
        """Starts a shadow request for this client request if it is sampled and there is room; returns the
        pair the primary side reports to, or None."""
        if self._closed or primary == self.name:
            return None
        if self.fraction < 1.0 and self._random() >= self.fraction:
            return None
        if len(self._tasks) >= self.max_concurrency:
            self._count(primary, "dropped")
            return None
        if not self.backend.readiness()[0]:
            self._count(primary, "unavailable")
            return None
        greedy = request is not None and request.sampling.temperature == 0
        pair = ShadowPair(self, primary, greedy)
        self.load.shadow_in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(pair, factory, request), name=f"shadow-{self.name}")
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, pair))
        return pair

    @property
    def active(self) -> int:
        """Shadow requests running (or about to)."""
        return len(self._tasks)

    def _finished(self, pair: ShadowPair, task: asyncio.Task[None]) -> None:
        """Runs however the task ended, even when it was cancelled before it ever started."""
        self._tasks.discard(task)
        self.load.shadow_in_flight -= 1
        if task.cancelled():
            self._count(pair.primary_backend, "cancelled")

    async def _run(self, pair: ShadowPair, factory: EventFactory, request: GenerateRequest | None) -> None:
        capture = pair.shadow
        capture.started = time.perf_counter()
        events: EventStream[Event] | None = None
        # The task was started by the client's request, so its trace's span is current here (a copied context).
        call = self._tracing.backend_call(self.backend, request, "shadow") if self._tracing is not None else None
        failure: BaseException | None = None
        try:
            events = factory(_OffTheRecord(self.backend if call is None else call.backend))
            async for event in events:
                capture.observe(event)
                if call is not None:
                    call.observe(event)
            capture.end(OK)
        except asyncio.CancelledError as exc:
            failure = exc
            capture.end(CANCELLED)  # counted by _finished
            raise
        except Exception as exc:  # the shadow's failure is never the client's: log it, count it at settle
            failure = exc
            logger.warning("shadow request of model %s to %s failed: %r", self.model, self.name, exc)
            capture.end(FAILED)
        finally:
            if events is not None:
                await events.aclose()
            if call is not None:
                call.end(failure)
        if pair.primary.outcome is not None:
            self.settle(pair)

    def settle(self, pair: ShadowPair) -> None:
        """Both sides ended: count the outcome and, when both answered, compare them (once per pair)."""
        primary, shadow = pair.primary, pair.shadow
        if pair.settled or shadow.outcome == CANCELLED:
            return
        pair.settled = True
        if shadow.outcome != OK:
            self._count(pair.primary_backend, "shadow_failed")
            return
        if primary.outcome != OK:
            self._count(pair.primary_backend, "primary_failed")
            return
        self._count(pair.primary_backend, "compared")
        m = self._metrics
        labels = (self.model, pair.primary_backend, self.name)
        summary = self.summaries.setdefault(pair.primary_backend, ComparisonSummary())
        summary.compared += 1
        greedy = "true" if pair.greedy else "false"
        checks = [
            ("finish_reason", primary.finishes == shadow.finishes),
            ("completion_tokens", primary.tokens == shadow.tokens),
        ]
        if pair.greedy:
            summary.greedy += 1
            checks.append(("text", primary.text() == shadow.text()))
        for aspect, same in checks:
            m.shadow_comparisons.labels(*labels, aspect, "match" if same else "mismatch", greedy).inc()
            summary.checks[aspect][0 if same else 1] += 1
        for side, capture in (("primary", primary), ("shadow", shadow)):
            m.shadow_tokens.labels(*labels, side).inc(capture.tokens)
            if capture.ttft is not None:
                m.shadow_ttft.labels(*labels, side).observe(capture.ttft)
                summary.ttft[side].add(capture.ttft)
            if capture.tpot is not None:
                m.shadow_tpot.labels(*labels, side).observe(capture.tpot)
                summary.tpot[side].add(capture.tpot)

    def _count(self, primary: str, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self._metrics.shadow_requests.labels(self.model, primary, self.name, outcome).inc()

    async def aclose(self) -> None:
        """Cancels every running shadow request (at shutdown; they abort their backend work)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def describe(self) -> dict[str, Any]:
        ready, reason = self.backend.readiness()
        return {
            "backend": self.name,
            "kind": self.backend.kind,
            "ready": ready,
            "reason": reason,
            "fraction": self.fraction,
            "max_concurrency": self.max_concurrency,
            "in_flight": self.active,
            "outcomes": dict(sorted(self.outcomes.items())),
            "comparisons": {primary: s.describe() for primary, s in sorted(self.summaries.items())},
        }


class _OffTheRecord(WrappedBackend):
    """The shadow backend as its copy of a client's request reaches it: the request's access-log line is the
    client's, so the shadow's admission (its tier, its queue wait) is not written into it."""

    __slots__ = ()

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        return self.inner.generate(dataclasses.replace(request, log=None))

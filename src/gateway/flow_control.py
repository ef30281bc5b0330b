"""Flow control in front of one backend: which waiting request gets the next free slot, and which is told no at once.

- Service tiers (``SERVICE_TIERS``, best first): a free slot goes to the best tier that has a waiter.
- Inside a tier, vLLM's ``priority`` first (lower first), then start-time fair queuing across flows: a flow is the
  API key a request came with (on a gateway without keys, the client's ``user``; without one, everyone is one
  flow). A request's start tag is the later of the tier's virtual time and its flow's last finish tag; its finish
  tag adds its cost (prompt estimate plus ``max_tokens`` times ``n``) over its key's weight. Slots go to the lowest
  start tag, and the virtual time follows the tags of the requests admitted. So a key that floods queues behind its
  own backlog and gets its weighted share, while a light key's request starts at the current virtual time, ahead
  of that backlog.
- Each tier has its own queue bound and timeout. A request that would wait longer than its tier's timeout (the
  waiters served before it, in its tier and the better ones, against the mean time a slot was held lately) is
  refused at arrival, with a ``Retry-After`` of that predicted wait, instead of after waiting the timeout out.

With ``flow_control: fifo`` there is one first-come queue under the default tier's bound and timeout: what the
gateway did before tiers, and the baseline ``bench/flow_control.py`` compares against. Times come from an
injected clock; timeouts are the event loop's timers.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram

from backends.config import AdmissionConfig
from backends.errors import OverloadedError
from backends.interface import CLIENT_SERVICE_TIERS, IMAGE_TOKENS_BOUND, SERVICE_TIERS, GenerateRequest
from gateway.server_config import ApiKeyConfig

Clock = Callable[[], float]
ShedReason = Literal["queue_full", "predicted_wait", "timeout"]

ANONYMOUS = "anonymous"
"""The key label of requests on a gateway without client keys (``gateway.auth.ANONYMOUS``)."""
TIER_TIMEOUT_FACTORS: Mapping[str, float] = {"priority": 1 / 6, "default": 1.0, "flex": 4.0, "batch": 20.0}
"""A tier's queue timeout, as a multiple of the backend's ``queue_timeout``, unless its ``tiers`` entry sets one:
``priority`` is refused rather than queued long, ``flex`` and ``batch`` wait longest."""
BYTES_PER_TOKEN = 4
DEFAULT_OUTPUT_ESTIMATE = 512
"""Output tokens a request that names no ``max_tokens`` is costed at (``server.limits.token_reservation``'s default)."""
SERVICE_SMOOTHING = 0.1
"""Weight of the newest slot-holding time in the running mean the predicted wait uses."""
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class TierBounds:
    """One tier's queue: how many of its requests may wait, and for how long."""

    max_queue: int
    queue_timeout: float


def tier_bounds(config: AdmissionConfig | None) -> dict[str, TierBounds]:
    """Every tier's bounds from a backend's admission config (``max_queue``, ``queue_timeout``, ``tiers``); with
    none, the defaults'."""
    config = config if config is not None else AdmissionConfig()
    bounds = {}
    for tier in SERVICE_TIERS:
        override = config.tiers.get(tier)  # type: ignore[call-overload]
        own_queue = override.max_queue if override is not None else None
        own_timeout = override.queue_timeout if override is not None else None
        bounds[tier] = TierBounds(
            own_queue if own_queue is not None else config.max_queue,
            own_timeout if own_timeout is not None else config.queue_timeout * TIER_TIMEOUT_FACTORS[tier],
        )
    return bounds


def request_cost(request: GenerateRequest, output_estimate: int = DEFAULT_OUTPUT_ESTIMATE) -> int:
    """What a request costs its flow, in tokens: its prompt (counted, or estimated at 4 bytes a token) plus its
    ``max_tokens`` (or ``output_estimate``), for each of its ``n`` choices' output."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.prompt is not None:
        prompt = len(request.prompt) // BYTES_PER_TOKEN
    else:
        prompt = sum(_content_chars(m.get("content")) for m in request.messages or ()) // BYTES_PER_TOKEN
    output = request.sampling.max_tokens
    return 1 + prompt + (output if output is not None else output_estimate) * max(1, request.n)


def _content_chars(content: object) -> int:
    """A message's text length; an image counts as the text of the most tokens it can take."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            IMAGE_TOKENS_BOUND * BYTES_PER_TOKEN if part.get("type") == "image_url" else len(part.get("text") or "")
            for part in content
            if isinstance(part, dict)
        )
    return 0


class KeyTiers:
    """Which service tiers each API key may use, its default tier and its weight (``server.auth.api_keys``).

    A request that asks for a tier its key may not use gets the key's default tier, echoed in the response, not
    an error (OpenAI's behaviour). Without client keys every online tier is open and ``default`` is the default.
    """

    def __init__(self, keys: Sequence[tuple[str, ApiKeyConfig]]) -> None:
        """``keys``: every client key with its label (``gateway.auth.key_label``)."""
        self._allowed = {label: tuple(key.service_tiers) for label, key in keys}
        self._default = {label: _default_tier(key) for label, key in keys}
        self.weights = {label: key.weight for label, key in keys}

    def tier_for(self, label: str, asked: str | None) -> str:
        """The tier a request of the key ``label`` is served in, when it asked for ``asked`` (None or ``auto``:
        the key's default; ``fast``: ``priority``, which OpenAI echoes for it)."""
        if asked == "fast":
            asked = "priority"
        allowed = self._allowed.get(label)
        if allowed is None:  # no client keys: every online tier is open
            return asked if asked in CLIENT_SERVICE_TIERS else "default"
        if asked in allowed and asked in CLIENT_SERVICE_TIERS:
            return asked
        return self._default[label]


def _default_tier(key: ApiKeyConfig) -> str:
    if key.default_service_tier is not None:
        return key.default_service_tier
    if "default" in key.service_tiers:
        return "default"
    return min(key.service_tiers, key=SERVICE_TIERS.index)


class FlowMetrics:
    """The wait and shed series of every backend's flow control (the queue depths are read at scrape time)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.wait = Histogram(
            "gateway_admission_wait_seconds",
            "Time requests waited for an admission slot (admitted, shed or timed out), by service tier and key.",
            ("backend", "tier", "key"),
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.shed = Counter(
            "gateway_admission_shed",
            "Requests refused by flow control (503): queue_full, predicted_wait (refused at arrival) or timeout.",
            ("backend", "tier", "key", "reason"),
            registry=registry,
        )


@dataclass(slots=True)
class Admission:
    """What admission did with one request: its tier, how many were served before it, how long it waited."""

    tier: str
    key: str
    ahead: int
    waited: float = 0.0
    outcome: str = "admitted"  # or queue_full, predicted_wait, timeout, left

    def log_fields(self) -> dict[str, str | int | float]:
        return {
            "service_tier": self.tier,
            "admission": self.outcome,
            "queue_ahead": self.ahead,
            "queue_ms": round(self.waited * 1000, 3),
        }


class _Waiter:
    __slots__ = ("flow", "future", "gone", "label", "tier")

    def __init__(self, future: asyncio.Future[None], tier: str, flow: str, label: str) -> None:
        self.future = future
        self.tier = tier
        self.flow = flow
        self.label = label
        self.gone = False  # left the queue (timed out, cancelled): skipped when it comes up


class _TierQueue:
    """One tier's waiters, ordered by (priority, start tag, arrival), and its flows' finish tags."""

    __slots__ = ("bounds", "finish", "flow_queued", "heap", "queued", "virtual")

    def __init__(self, bounds: TierBounds) -> None:
        self.bounds = bounds
        self.heap: list[tuple[int, float, int, _Waiter]] = []
        self.queued = 0
        self.virtual = 0.0
        self.finish: dict[str, float] = {}
        self.flow_queued: dict[str, int] = {}

    def push(self, waiter: _Waiter, priority: int, cost: float, seq: int) -> tuple[int, float, int]:
        start = max(self.virtual, self.finish.get(waiter.flow, 0.0))
        self.finish[waiter.flow] = start + cost
        self.flow_queued[waiter.flow] = self.flow_queued.get(waiter.flow, 0) + 1
        entry = (priority, start, seq, waiter)
        heapq.heappush(self.heap, entry)
        self.queued += 1
        return entry[:3]

    def ahead_of(self, order: tuple[int, float, int]) -> int:
        return sum(1 for entry in self.heap if not entry[3].gone and entry[:3] < order)

    def pop(self) -> _Waiter | None:
        while self.heap:
            _, start, _, waiter = heapq.heappop(self.heap)
            if waiter.gone:
                continue
            self.virtual = max(self.virtual, start)
            self._left(waiter)
            return waiter
        return None

    def remove(self, waiter: _Waiter) -> None:
        """A waiter that leaves before its turn: skipped when it comes up."""
        waiter.gone = True
        self._left(waiter)

    def _left(self, waiter: _Waiter) -> None:
        self.queued -= 1
        left = self.flow_queued[waiter.flow] - 1
        if left:
            self.flow_queued[waiter.flow] = left
        else:
            del self.flow_queued[waiter.flow]
        if not self.queued:  # idle: every flow starts even again, and nothing is remembered for long
            self.heap.clear()
            self.finish.clear()
            self.virtual = 0.0
        elif len(self.finish) > 2 * len(self.flow_queued) + 64:
            self.finish = {f: t for f, t in self.finish.items() if f in self.flow_queued or t > self.virtual}


class FlowController:
    """Bounds one backend's in-flight requests and decides who waits for a slot, in which order, and who not.

    ``weights`` are the keys' shares (``api_keys[].weight``), by key label; unnamed flows weigh 1.
    """

    def __init__(
        self,
        name: str,
        max_in_flight: int | None,
        tiers: Mapping[str, TierBounds],
        *,
        fair: bool = True,
        weights: Mapping[str, float] | None = None,
        clock: Clock = time.monotonic,
        metrics: FlowMetrics | None = None,
    ) -> None:
        self.name = name
        self.max_in_flight = max_in_flight
        self.fair = fair
        self.bounds = dict(tiers)
        self._weights = dict(weights or {})
        self._clock = clock
        self._metrics = metrics
        self._queues = {tier: _TierQueue(self.bounds[tier]) for tier in (SERVICE_TIERS if fair else ("default",))}
        self._depth: dict[tuple[str, str], int] = {}
        self._sequence = itertools.count()
        self.in_flight = 0
        self.rejected = 0
        self.mean_service: float | None = None
        """Seconds a slot was held, a running mean; None until a request has finished."""

    @property
    def queued(self) -> int:
        return sum(q.queued for q in self._queues.values())

    def depths(self) -> Iterator[tuple[str, str, int]]:
        """(tier, key label, waiting requests) for every pair with waiters."""
        for (tier, key), count in self._depth.items():
            yield tier, key, count

    def predicted_wait(self, ahead: int) -> float | None:
        """Seconds until ``ahead`` waiters and then one more got a slot, at the recent rate slots come free."""
        if self.mean_service is None or not self.max_in_flight:
            return None
        return (ahead + 1) * self.mean_service / self.max_in_flight

    def admission_of(self, request: GenerateRequest) -> Admission:
        """The record ``acquire`` fills in for ``request``: its tier (``default`` for a name it does not know) and
        key label."""
        tier = request.service_tier if request.service_tier in self.bounds else "default"
        return Admission(tier, request.tenant or ANONYMOUS, 0)

    async def acquire(self, request: GenerateRequest, admission: Admission) -> None:
        """Waits for a slot for ``request``, filling in ``admission`` (``admission_of``) whatever happens; raises
        ``OverloadedError`` (503, Retry-After) when its tier's queue is full, when its predicted wait exceeds its
        tier's timeout, or when it waited the timeout out."""
        tier, key = admission.tier, admission.key
        if self.max_in_flight is None or (self.in_flight < self.max_in_flight and not self.queued):
            self.in_flight += 1
            self._observe(admission)
            return
        queue = self._queues[tier if self.fair else "default"]
        bounds = self.bounds[tier if self.fair else "default"]
        waiter = self._enqueue(request, admission, queue, bounds)
        self._count(tier, key, 1)
        arrived = self._clock()
        try:
            await self._await_slot(waiter, queue, bounds, admission, arrived)
        finally:
            self._count(tier, key, -1)
        admission.waited = self._clock() - arrived
        self._observe(admission)

    def _enqueue(
        self, request: GenerateRequest, admission: Admission, queue: _TierQueue, bounds: TierBounds
    ) -> _Waiter:
        """Queue a waiter for ``request`` and note how many are ahead of it; refuse it if the queue is full or
        its predicted wait is longer than its tier waits."""
        if queue.queued >= bounds.max_queue:
            self._shed(admission, "queue_full")
            raise OverloadedError(
                f"backend {self.name!r} is saturated ({self.in_flight} in flight, {queue.queued} queued in the "
                f"{admission.tier} tier)",
                retry_after=self._retry_after(self.queued),
                code="backend_saturated",
            )
        key = admission.key
        flow = key if key != ANONYMOUS or not request.user else f"user:{request.user}"
        waiter = _Waiter(asyncio.get_running_loop().create_future(), admission.tier, flow, key)
        if self.fair:
            cost = request_cost(request) / self._weights.get(key, 1.0)
            order = queue.push(waiter, request.priority, cost, next(self._sequence))
            admission.ahead = self._ahead_in_better_tiers(admission.tier) + queue.ahead_of(order)
        else:
            queue.push(waiter, 0, 0.0, next(self._sequence))
            admission.ahead = queue.queued - 1
        predicted = self.predicted_wait(admission.ahead)
        if predicted is not None and predicted > bounds.queue_timeout:
            queue.remove(waiter)
            self._shed(admission, "predicted_wait")
            raise OverloadedError(
                f"backend {self.name!r} is saturated: {admission.ahead} requests would be served before this one, "
                f"about {predicted:.1f} s, longer than the {admission.tier} tier waits ({bounds.queue_timeout:g} s)",
                retry_after=predicted,
                code="backend_saturated",
            )
        return waiter

    async def _await_slot(
        self, waiter: _Waiter, queue: _TierQueue, bounds: TierBounds, admission: Admission, arrived: float
    ) -> None:
        """Wait up to the tier's timeout for ``waiter`` to be handed a slot; on timeout or cancellation it leaves
        the queue (a slot handed over meanwhile is kept on timeout, passed on when the caller goes away)."""
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), bounds.queue_timeout)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return  # the slot arrived just as the wait ran out: keep it
            waiter.future.cancel()
            queue.remove(waiter)
            admission.waited = self._clock() - arrived
            self._shed(admission, "timeout")
            raise OverloadedError(
                f"backend {self.name!r} stayed saturated for {bounds.queue_timeout:g} s",
                retry_after=self._retry_after(self.queued),
                code="backend_saturated",
            ) from None
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(0.0)  # handed a slot but going away: pass it on
            else:
                waiter.future.cancel()
                queue.remove(waiter)
            admission.outcome = "left"
            admission.waited = self._clock() - arrived
            raise

    def release(self, service_seconds: float) -> None:
        """A slot is free (held ``service_seconds``): it passes to the next waiter, if any."""
        if service_seconds > 0:
            mean = self.mean_service
            smoothed = service_seconds if mean is None else mean + SERVICE_SMOOTHING * (service_seconds - mean)
            self.mean_service = smoothed
        for queue in self._queues.values():
            waiter = queue.pop()
            if waiter is not None:
                waiter.future.set_result(None)  # the slot passes straight to it
                return
        self.in_flight -= 1

    def _ahead_in_better_tiers(self, tier: str) -> int:
        ahead = 0
        for name, queue in self._queues.items():
            if name == tier:
                break
            ahead += queue.queued
        return ahead

    def _retry_after(self, ahead: int) -> float:
        return max(1.0, self.predicted_wait(ahead) or 1.0)

    def _count(self, tier: str, key: str, delta: int) -> None:
        depth = self._depth.get((tier, key), 0) + delta
        if depth:
            self._depth[(tier, key)] = depth
        else:
            self._depth.pop((tier, key), None)

    def _observe(self, admission: Admission) -> None:
        if self._metrics is not None:
            self._metrics.wait.labels(self.name, admission.tier, admission.key).observe(admission.waited)

    def _shed(self, admission: Admission, reason: ShedReason) -> None:
        self.rejected += 1
        admission.outcome = reason
        if self._metrics is not None:
            self._metrics.wait.labels(self.name, admission.tier, admission.key).observe(admission.waited)
            self._metrics.shed.labels(self.name, admission.tier, admission.key, reason).inc()

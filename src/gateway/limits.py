"""Per-key request and token limits (429) and per-backend admission control (503), both with Retry-After.

Budgets are token buckets that refill over a minute (``gateway.budgets``). A request takes one request and
reserves tokens when it is admitted (its ``max_tokens``, or ``server.token_reservation`` when it names none,
never more than the budget), and is settled with its real usage when it ends, so concurrent requests cannot all
pass a spent budget. With ``server.state_store`` the buckets live in Redis and are exact across processes and
replicas; without it, or while the store is down, each of a host's N front-end processes allows 1/N of every
budget. Admission bounds a backend's in-flight requests and keeps a bounded FIFO of waiters with a timeout:
never an unbounded queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import NamedTuple

from backends.errors import OverloadedError
from gateway.budgets import BudgetStore, Clock, Draw, LocalBudgets, RedisBudgets, Take, seconds_until
from gateway.config import ApiKeyConfig, ServerConfig
from gateway.errors import APIError
from gateway.state_store import STORE_FAILURES, SharedStateStore

logger = logging.getLogger(__name__)


class Admission(NamedTuple):
    """What admitting a request took from its key's budgets, and the rate-limit headers to send."""

    label: str
    reserved_tokens: int
    headers: dict[str, str]


class KeyLimits:
    """Requests-per-minute and tokens-per-minute budgets for every client key label."""

    def __init__(
        self,
        server: ServerConfig,
        *,
        store: SharedStateStore | None = None,
        processes: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        self._limits: dict[str, tuple[int | None, int | None]] = {}
        for position, key in enumerate(server.client_keys()):
            label = key.name or f"key-{position}"
            self._limits[label] = _limits_of(key, server)
        self._default = (server.requests_per_minute, server.tokens_per_minute)
        self._reservation = server.token_reservation
        self._local = LocalBudgets(clock, share=1.0 / processes)
        self.store = store
        self._shared: BudgetStore | None = RedisBudgets(store.client) if store is not None else None
        self._settling: set[asyncio.Task[None]] = set()

    def limits_of(self, label: str) -> tuple[int | None, int | None]:
        return self._limits.get(label, self._default)

    async def admit(self, label: str, max_tokens: int | None) -> Admission:
        """Takes one request and reserves tokens from the key's budgets; raises a 429 with Retry-After when
        a budget cannot cover it."""
        rpm, tpm = self.limits_of(label)
        if rpm is None and tpm is None:
            return Admission(label, 0, {})
        draws: list[Draw] = []
        reserved = 0
        if rpm is not None:
            draws.append(Draw(f"{label}:requests", rpm, 1, 1))
        if tpm is not None:
            reserved = min(tpm, max_tokens if max_tokens is not None else self._reservation)
            draws.append(Draw(f"{label}:tokens", tpm, max(1, reserved), reserved))
        take = await self._take(draws)
        headers: dict[str, str] = {}
        waits: list[float] = []
        for draw, level in zip(draws, take.levels, strict=True):
            kind = "requests" if draw.key.endswith(":requests") else "tokens"
            headers[f"x-ratelimit-limit-{kind}"] = str(int(draw.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{kind}"] = f"{seconds_until(level, draw.capacity, draw.capacity):.3f}s"
            if not take.granted and level < min(draw.require, draw.capacity):
                waits.append(seconds_until(level, min(draw.require, draw.capacity), draw.capacity))
        if not take.granted:
            retry = max(waits, default=1.0)
            raise APIError(
                429,
                f"Rate limit reached for {label}: retry after {retry:.1f} s.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(max(1, math.ceil(retry)))},
            )
        return Admission(label, reserved, headers)

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Charges the request's real usage against what it reserved (called once, when it ends)."""
        _, tpm = self.limits_of(admission.label)
        delta = admission.reserved_tokens - used_tokens
        if tpm is None or delta == 0:
            return
        task = asyncio.get_running_loop().create_task(self._adjust(f"{admission.label}:tokens", tpm, delta))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _take(self, draws: list[Draw]) -> Take:
        if self._shared is not None and self.store is not None and self.store.usable():
            try:
                take = await self._shared.take(draws)
            except STORE_FAILURES as exc:
                self.store.failed(exc)
            else:
                self.store.succeeded()
                return take
        return await self._local.take(draws)

    async def _adjust(self, key: str, capacity: float, delta: float) -> None:
        if self._shared is not None and self.store is not None and self.store.usable():
            try:
                await self._shared.adjust(key, capacity, delta)
            except STORE_FAILURES as exc:
                self.store.failed(exc)
            else:
                self.store.succeeded()
                return
        await self._local.adjust(key, capacity, delta)


def _limits_of(key: ApiKeyConfig, server: ServerConfig) -> tuple[int | None, int | None]:
    return (
        key.requests_per_minute if key.requests_per_minute is not None else server.requests_per_minute,
        key.tokens_per_minute if key.tokens_per_minute is not None else server.tokens_per_minute,
    )


class AdmissionGate:
    """Bounds one backend's in-flight requests, with a bounded, timed FIFO of waiters."""

    def __init__(self, name: str, max_in_flight: int | None, max_queue: int, queue_timeout: float) -> None:
        self.name = name
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._mean_service = 1.0  # seconds, exponentially weighted; feeds Retry-After
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> float:
        slots = self.max_in_flight or 1
        return max(1.0, (len(self._waiters) + 1) * self._mean_service / slots)

    async def acquire(self) -> None:
        if self.max_in_flight is None or (self.in_flight < self.max_in_flight and not self._waiters):
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queue:
            self.rejected += 1
            raise OverloadedError(
                f"backend {self.name!r} is saturated ({self.in_flight} in flight, {len(self._waiters)} queued)",
                retry_after=self.retry_after(),
                code="backend_saturated",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot arrived just as the wait ran out: keep it
            waiter.cancel()
            self.rejected += 1
            raise OverloadedError(
                f"backend {self.name!r} stayed saturated for {self.queue_timeout:.0f} s",
                retry_after=self.retry_after(),
                code="backend_saturated",
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(0.0)  # we were handed a slot but are going away: pass it on
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, service_seconds: float) -> None:
        if service_seconds > 0:
            self._mean_service = 0.9 * self._mean_service + 0.1 * service_seconds
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next waiter
                return
        self.in_flight -= 1

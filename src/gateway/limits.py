"""Per-key request and token limits (429) and per-backend admission control (503), both with Retry-After.

Token buckets refill continuously; tokens are charged when a request finishes (its usage is known then), so
a key may overdraw once and then waits until the bucket refills. Admission bounds a backend's in-flight
requests and keeps a bounded FIFO of waiters with a timeout: never an unbounded queue.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field

from backends.errors import OverloadedError
from gateway.config import ApiKeyConfig, ServerConfig
from gateway.errors import APIError


@dataclass
class _Bucket:
    capacity: float
    level: float
    updated: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)


class KeyLimits:
    """Requests-per-minute and tokens-per-minute buckets for every client key label."""

    def __init__(self, server: ServerConfig) -> None:
        self._limits: dict[str, tuple[int | None, int | None]] = {}
        for position, key in enumerate(server.client_keys()):
            label = key.name or f"key-{position}"
            self._limits[label] = _limits_of(key, server)
        self._default = (server.requests_per_minute, server.tokens_per_minute)
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def admit(self, label: str) -> dict[str, str]:
        """Takes one request from the key's budget; raises a 429 with Retry-After when it is spent."""
        rpm, tpm = self._limits.get(label, self._default)
        if rpm is None and tpm is None:
            return {}
        now = time.monotonic()
        headers: dict[str, str] = {}
        waits: list[float] = []
        if rpm is not None:
            bucket = self._requests.setdefault(label, _Bucket(rpm, rpm, now))
            bucket.refill(now)
            if bucket.level < 1:
                waits.append(bucket.seconds_until(1))
            headers["x-ratelimit-limit-requests"] = str(rpm)
            headers["x-ratelimit-reset-requests"] = f"{bucket.seconds_until(bucket.capacity):.3f}s"
        if tpm is not None:
            bucket = self._tokens.setdefault(label, _Bucket(tpm, tpm, now))
            bucket.refill(now)
            if bucket.level <= 0:
                waits.append(bucket.seconds_until(1))
            headers["x-ratelimit-limit-tokens"] = str(tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(bucket.level)))
            headers["x-ratelimit-reset-tokens"] = f"{bucket.seconds_until(bucket.capacity):.3f}s"
        if waits:
            retry = max(waits)
            if rpm is not None:
                headers["x-ratelimit-remaining-requests"] = "0"
            raise APIError(
                429,
                f"Rate limit reached for {label}: retry after {retry:.1f} s.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(max(1, math.ceil(retry)))},
            )
        if rpm is not None:
            self._requests[label].level -= 1
            headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self._requests[label].level)))
        return headers

    def charge(self, label: str, tokens: int) -> None:
        bucket = self._tokens.get(label)
        if bucket is not None and tokens:
            bucket.refill(time.monotonic())
            bucket.level -= tokens


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

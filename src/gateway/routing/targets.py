"""A target is one backend as one model's route: its share, its load, its breaker and its recent latencies."""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from backends.interface import Backend
from gateway.routing.breaker import CircuitBreaker

LATENCY_WINDOW = 256
"""Latencies kept per target for the operator endpoint's percentiles: recent enough to show a change in
minutes, small enough to sort on every look."""


class BackendLoad:
    """Requests the router sent to one backend and has not seen end, over every model that uses the backend
    (a backend shared by two models is loaded by both)."""

    __slots__ = ("in_flight", "shadow_in_flight")

    def __init__(self) -> None:
        self.in_flight = 0
        self.shadow_in_flight = 0

    @property
    def total(self) -> int:
        return self.in_flight + self.shadow_in_flight


class LatencyWindow:
    """The last ``LATENCY_WINDOW`` values of one latency, for percentiles on demand."""

    __slots__ = ("_values",)

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def __len__(self) -> int:
        return len(self._values)

    def percentiles_ms(self) -> dict[str, float] | None:
        """Nearest-rank p50 / p90 / p99 in milliseconds, or None before the first sample."""
        if not self._values:
            return None
        ordered = sorted(self._values)
        n = len(ordered)
        return {f"p{q}": round(ordered[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))] * 1000, 3) for q in (50, 90, 99)}


def stable_hash64(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(eq=False, slots=True)
class Target:
    """One backend behind one model. ``weight`` is its share in the model's policy (0: never chosen by the
    policy, only pinned or as a fallback)."""

    model: str
    backend: Backend
    weight: float
    load: BackendLoad
    breaker: CircuitBreaker
    primary: bool = True
    fallback: bool = False
    seed: int = 0
    ttft: LatencyWindow = field(default_factory=LatencyWindow)
    e2e: LatencyWindow = field(default_factory=LatencyWindow)
    requests: int = 0
    failures: int = 0
    routed: dict[str, Any] = field(default_factory=dict)
    """Prometheus counter children by ``via`` label, resolved once instead of per request."""

    def __post_init__(self) -> None:
        self.seed = stable_hash64(self.backend.name.encode())

    @property
    def name(self) -> str:
        return self.backend.name

    def available(self) -> bool:
        """Ready and not cut off by its breaker."""
        return self.breaker.available() and self.backend.readiness()[0]

    def unavailable_reason(self) -> str:
        ready, reason = self.backend.readiness()
        if not ready:
            return reason
        return f"circuit {self.breaker.state}, next probe in {self.breaker.retry_in():.1f} s"

    def describe(self) -> dict[str, Any]:
        ready, reason = self.backend.readiness()
        breaker = self.breaker
        roles = [r for r, on in (("primary", self.primary), ("fallback", self.fallback)) if on]
        return {
            "backend": self.name,
            "kind": self.backend.kind,
            "roles": roles,
            "weight": self.weight if self.primary else None,
            "ready": ready,
            "reason": reason,
            "in_flight": self.load.in_flight,
            "shadow_in_flight": self.load.shadow_in_flight,
            "requests": self.requests,
            "failures": self.failures,
            "circuit": {
                "state": breaker.state,
                "consecutive_failures": breaker.failures,
                "failure_threshold": breaker.threshold,
                "times_opened": breaker.opens,
                "next_probe_in_seconds": round(breaker.retry_in(), 3),
            },
            "latency": {
                "samples": len(self.e2e),
                "ttft_ms": self.ttft.percentiles_ms(),
                "e2e_ms": self.e2e.percentiles_ms(),
            },
        }

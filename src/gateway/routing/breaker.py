"""Per-target circuit breaker: stop sending requests to a target that keeps failing, probe it after a cool-down."""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0.0, HALF_OPEN: 1.0, OPEN: 2.0}
"""Gauge values of ``gateway_circuit_state``."""


class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failures; open -> half-open once ``cooldown`` passed, when
    one probe request may go through; the probe's first event closes the circuit, its failure reopens it.

    Half-open is not stored: it is "open, and the cool-down is over", so an idle target is probed by the next
    request that wants it without a timer.
    """

    __slots__ = ("clock", "cooldown", "failures", "opened_at", "opens", "probing_since", "threshold")

    def __init__(self, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.probing_since: float | None = None
        self.opens = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        return OPEN if self.clock() - self.opened_at < self.cooldown else HALF_OPEN

    def retry_in(self) -> float:
        """Seconds until a probe may go through (0 when it may now)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown - self.clock())

    def available(self) -> bool:
        """May a request be sent now? In half-open only while no probe is out (a probe that never reported
        back is replaced after another cool-down)."""
        if self.opened_at is None:
            return True
        now = self.clock()
        if now - self.opened_at < self.cooldown:
            return False
        return self.probing_since is None or now - self.probing_since >= self.cooldown

    def acquire(self) -> bool:
        """A request is being sent; outside the closed state it is the probe (returns True then)."""
        if self.opened_at is None:
            return False
        self.probing_since = self.clock()
        return True

    def answered(self) -> None:
        """The target produced its first event: it works, so an open circuit closes."""
        if self.opened_at is not None:
            self.opened_at = None
            self.probing_since = None
            self.failures = 0

    def succeeded(self) -> None:
        """A request ended normally."""
        self.failures = 0

    def failed(self) -> None:
        """A request failed because of the target (not the client's fault, not overload)."""
        now = self.clock()
        if self.opened_at is not None:
            self.opened_at = now  # the probe (or a straggler) failed: stay open for another cool-down
            self.probing_since = None
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now
            self.opens += 1

    def released(self) -> None:
        """The probe ended without telling anything about the target (client went away, overload, bad input):
        the next request may probe."""
        self.probing_since = None

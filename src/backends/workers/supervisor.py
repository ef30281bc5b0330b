"""Decides when data-parallel ranks start again: per-unit exponential backoff, a start deadline, and backoff that
decays after a stable uptime.

A pure state machine: it never touches a process or a socket. The driver tells it what happened to a rank
(``ready``, ``failed``, ``exited``: its process is gone) and it acts through ``RankControl`` (launch these ranks,
take this rank down) and through timers on an injected ``Clock`` (the event loop in the driver, a fake clock in
``tests/backends/workers/test_supervisor.py``).

A *unit* is what fails and restarts together: one rank, or in lockstep the whole group (a dead rank leaves its
peers blocked inside a collective). Each unit has its own timer, deadline and backoff, so one rank failing never
delays or cancels another's restart. A timer that fires before its due time (clocks of different resolution, e.g.
uvloop's milliseconds) is armed again for the rest, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


class Timer(Protocol):
    """A pending callback (``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time and timers; ``asyncio.AbstractEventLoop`` is one."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


class RankControl(Protocol):
    """What the supervisor asks of the driver."""

    def launch(self, ranks: Sequence[int]) -> None:
        """Start these ranks now (one unit: in lockstep the whole group, as one new group)."""

    def take_down(self, rank: int, reason: str, restart_in: float) -> None:
        """Stop serving from the rank, fail its requests and kill its process (if the driver started one)."""


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff ``initial_backoff * 2**failures`` capped at ``max_backoff``; ``failures`` counts failures in a row and
    starts again from 0 once a unit has been up ``stable_seconds``. A unit not ready ``start_timeout`` after its
    launch is taken down and counted as failed."""

    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    stable_seconds: float = 30.0
    start_timeout: float = 1800.0

    def backoff(self, failures: int) -> float:
        return min(self.max_backoff, self.initial_backoff * 2.0 ** min(failures, 64))


UnitState = Literal["starting", "up", "down", "closed"]


class Unit:
    """The supervisor's record of one unit; read by the driver and tests."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.state: UnitState = "down"
        self.failures = 0  # in a row; the next backoff is policy.backoff(failures)
        self.launches = 0
        self.up_since = 0.0
        self.due = 0.0  # starting: the start deadline; down: when the restart may happen
        self.ready: set[int] = set()
        self.running: set[int] = set()  # ranks whose process may still be alive (GPU memory not yet freed)
        self.timer: Timer | None = None
        self.epoch = 0


class RankSupervisor:
    """Supervises ``size`` ranks, as one unit (``lockstep``) or one unit per rank; see the module docstring.

    ``local``: the driver starts the ranks' processes and reports their exit; a relaunch waits for every old
    process of the unit to be gone. Remote ranks have no process of ours: nothing to wait for.
    """

    def __init__(
        self,
        size: int,
        policy: RestartPolicy,
        clock: Clock,
        control: RankControl,
        *,
        lockstep: bool = False,
        local: bool = True,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.control = control
        self.local = local
        groups = [tuple(range(size))] if lockstep else [(i,) for i in range(size)]
        self.units = [Unit(ranks) for ranks in groups]
        self._unit_of = {rank: unit for unit in self.units for rank in unit.ranks}

    def start(self) -> None:
        """Launches every unit."""
        for unit in self.units:
            self._launch(unit)

    def close(self) -> None:
        """No more launches or deadlines (the driver is stopping)."""
        for unit in self.units:
            self._cancel(unit)
            unit.state = "closed"

    def ready(self, rank: int) -> None:
        """The rank reported ready; its unit is up once every rank of it is."""
        unit = self._unit_of[rank]
        if unit.state != "starting":
            return  # a late answer from an incarnation already taken down, or a repeat while up
        unit.ready.add(rank)
        if len(unit.ready) == len(unit.ranks):
            self._cancel(unit)
            unit.state = "up"
            unit.up_since = self.clock.time()

    def failed(self, rank: int, reason: str) -> None:
        """The rank failed (exited, reported failure, fell silent): its unit goes down and is relaunched after its
        backoff. Failures of a unit already down are the same failure."""
        unit = self._unit_of[rank]
        if unit.state in ("down", "closed"):
            return
        now = self.clock.time()
        if unit.state == "up" and now - unit.up_since >= self.policy.stable_seconds:
            unit.failures = 0
        delay = self.policy.backoff(unit.failures)
        unit.failures += 1
        unit.state = "down"
        unit.ready.clear()
        unit.due = now + delay
        self._arm(unit)
        if not self.local:
            unit.running.clear()
        for member in unit.ranks:
            why = reason if member == rank else f"lockstep group restart after rank {rank} failed"
            self.control.take_down(member, why, delay)

    def exited(self, rank: int) -> None:
        """The rank's process is gone; a unit that waited only for that launches now."""
        unit = self._unit_of[rank]
        unit.running.discard(rank)
        self._maybe_launch(unit)

    # ---- internals ---------------------------------------------------------------------------------------------

    def _launch(self, unit: Unit) -> None:
        unit.launches += 1
        unit.state = "starting"
        unit.ready.clear()
        if self.local:
            unit.running = set(unit.ranks)
        unit.due = self.clock.time() + self.policy.start_timeout
        self._arm(unit)
        self.control.launch(unit.ranks)  # last: it may report a failure at once

    def _maybe_launch(self, unit: Unit) -> None:
        if unit.state == "down" and not unit.running and self.clock.time() >= unit.due:
            self._launch(unit)

    def _arm(self, unit: Unit) -> None:
        self._cancel(unit)
        epoch = unit.epoch
        unit.timer = self.clock.call_at(unit.due, lambda: self._on_timer(unit, epoch))

    def _cancel(self, unit: Unit) -> None:
        unit.epoch += 1  # a timer of an older epoch that fires anyway does nothing
        if unit.timer is not None:
            unit.timer.cancel()
            unit.timer = None

    def _on_timer(self, unit: Unit, epoch: int) -> None:
        if epoch != unit.epoch:
            return
        unit.timer = None
        if self.clock.time() < unit.due:  # fired early: the clock's resolution is not the timer's
            self._arm(unit)
            return
        if unit.state == "starting":
            late = next(rank for rank in unit.ranks if rank not in unit.ready)
            self.failed(late, f"not ready within {self.policy.start_timeout:g} s of its start")
        elif unit.state == "down":
            self._maybe_launch(unit)  # or, if an old process is still alive, ``exited`` launches

"""The rank supervisor on a fake clock: restarts, backoff, start deadlines, early timers; no processes involved.

``FakeClock`` and ``RecordingDriver`` are test doubles of the event loop's clock and of the driver's side of
``RankControl``; they follow the real contracts (``loop.time``/``loop.call_at``, and launch/take_down). The driver
with real worker processes is tested in ``test_data_parallel.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from backends.workers.supervisor import RankSupervisor, RestartPolicy

POLICY = RestartPolicy(initial_backoff=0.5, max_backoff=8.0, stable_seconds=30.0, start_timeout=60.0)


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time moves only in ``advance``. ``early`` makes every timer fire that long before its due time, with the
    clock reading the earlier time, as an event loop whose clock is coarser than the due times does (uvloop:
    milliseconds). Time moves by at least ``tick`` between two rounds of callbacks, as it does between loop
    iterations."""

    def __init__(self, early: float = 0.0, tick: float = 0.001) -> None:
        self.now = 1024.0 - 0.0004  # just under a power of two, where a millisecond clock rounds
        self.early = early
        self.tick = tick
        self.timers: list[FakeTimer] = []
        self.fired = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> FakeTimer:
        timer = FakeTimer(when, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        target = self.now + seconds
        while True:
            self.timers = [t for t in self.timers if not t.cancelled]
            if not self.timers:
                break
            at = max(min(t.when for t in self.timers) - self.early, self.now + self.tick)
            if at > target:
                break
            self.now = at
            due = [t for t in self.timers if t.when - self.early <= at]
            for timer in due:
                self.timers.remove(timer)
                if not timer.cancelled:
                    self.fired += 1
                    timer.callback()
        self.now = target


class RecordingDriver:
    """The driver's side of ``RankControl``: records launches and take-downs; its processes exit when told."""

    def __init__(self) -> None:
        self.launches: list[tuple[float, tuple[int, ...]]] = []
        self.take_downs: list[tuple[int, str, float]] = []
        self.clock: FakeClock | None = None

    def launch(self, ranks: Sequence[int]) -> None:
        assert self.clock is not None
        self.launches.append((self.clock.time(), tuple(ranks)))

    def take_down(self, rank: int, reason: str, restart_in: float) -> None:
        self.take_downs.append((rank, reason, restart_in))

    def launched(self, rank: int) -> int:
        return sum(rank in ranks for _, ranks in self.launches)


def supervise(
    size: int, *, lockstep: bool = False, local: bool = True, early: float = 0.0, policy: RestartPolicy = POLICY
) -> tuple[RankSupervisor, FakeClock, RecordingDriver]:
    clock = FakeClock(early=early)
    driver = RecordingDriver()
    driver.clock = clock
    supervisor = RankSupervisor(size, policy, clock, driver, lockstep=lockstep, local=local)
    supervisor.start()
    for rank in range(size):
        supervisor.ready(rank)
    return supervisor, clock, driver


def crash(supervisor: RankSupervisor, rank: int, reason: str = "worker exited with signal SIGKILL") -> None:
    """What the driver reports when a worker process dies: the failure, then the process gone."""
    supervisor.failed(rank, reason)
    supervisor.exited(rank)


def states(supervisor: RankSupervisor) -> list[str]:
    return [unit.state for unit in supervisor.units]


# ---- restarts ----------------------------------------------------------------------------------------------------


def test_a_killed_rank_is_taken_down_and_relaunched_after_its_backoff() -> None:
    supervisor, clock, driver = supervise(2)
    assert states(supervisor) == ["up", "up"]
    crash(supervisor, 1)
    assert driver.take_downs == [(1, "worker exited with signal SIGKILL", 0.5)]
    assert states(supervisor) == ["up", "down"]
    clock.advance(0.49)
    assert driver.launched(1) == 1
    clock.advance(0.02)
    assert driver.launched(1) == 2 and driver.launched(0) == 1
    supervisor.ready(1)
    assert states(supervisor) == ["up", "up"]


@pytest.mark.parametrize("early", [0.0004, 0.0009])
def test_a_restart_timer_that_fires_early_is_armed_again(early: float) -> None:
    supervisor, clock, driver = supervise(2, early=early)
    crash(supervisor, 0)
    clock.advance(0.6)
    assert driver.launched(0) == 2
    assert clock.fired >= 2, "the timer fired early once, then again at its due time"
    assert states(supervisor)[0] == "starting"


def test_two_ranks_failing_in_one_window_both_come_back_each_after_its_own_backoff() -> None:
    supervisor, clock, driver = supervise(3)
    start = clock.time()
    crash(supervisor, 0)
    clock.advance(0.2)
    crash(supervisor, 2)  # inside rank 0's backoff
    clock.advance(1.0)
    relaunches = [(round(at - start, 3), ranks) for at, ranks in driver.launches[3:]]
    assert relaunches == [(0.5, (0,)), (0.7, (2,))]
    for rank in (0, 2):
        supervisor.ready(rank)
    assert states(supervisor) == ["up", "up", "up"]


def test_a_restart_waits_for_the_old_process_to_be_gone() -> None:
    supervisor, clock, driver = supervise(1)
    supervisor.failed(0, "silent for 10 s")  # the driver killed it; the exit is not seen yet
    clock.advance(5.0)
    assert driver.launched(0) == 1 and states(supervisor) == ["down"]
    supervisor.exited(0)
    assert driver.launched(0) == 2 and states(supervisor) == ["starting"]


def test_remote_ranks_have_no_process_to_wait_for() -> None:
    supervisor, clock, driver = supervise(2, local=False)
    supervisor.failed(1, "silent for 10 s")
    clock.advance(0.5)
    assert driver.launched(1) == 2


def test_a_second_failure_report_of_a_rank_already_down_changes_nothing() -> None:
    supervisor, clock, driver = supervise(1)
    supervisor.failed(0, "engine failed: boom")
    supervisor.failed(0, "worker exited with code 1")
    supervisor.exited(0)
    assert len(driver.take_downs) == 1
    clock.advance(0.5)
    assert driver.launched(0) == 2


def test_a_late_ready_from_a_rank_taken_down_does_not_bring_it_up() -> None:
    supervisor, clock, _ = supervise(1)
    crash(supervisor, 0)
    supervisor.ready(0)
    assert states(supervisor) == ["down"]
    clock.advance(0.5)
    assert states(supervisor) == ["starting"]


# ---- the start deadline ------------------------------------------------------------------------------------------


def test_a_rank_that_hangs_while_starting_is_taken_down_at_the_deadline_and_restarted() -> None:
    clock = FakeClock()
    driver = RecordingDriver()
    driver.clock = clock
    supervisor = RankSupervisor(2, POLICY, clock, driver)
    supervisor.start()
    supervisor.ready(0)
    clock.advance(59.9)
    assert states(supervisor) == ["up", "starting"] and driver.take_downs == []
    clock.advance(0.2)
    assert driver.take_downs == [(1, "not ready within 60 s of its start", 0.5)]
    supervisor.exited(1)  # the driver's kill took effect
    clock.advance(0.5)
    assert driver.launched(1) == 2
    supervisor.ready(1)
    assert states(supervisor) == ["up", "up"]
    clock.advance(120.0)  # the deadline of the first attempt is gone with it
    assert len(driver.take_downs) == 1


def test_repeated_hangs_while_starting_back_off_like_crashes() -> None:
    supervisor, clock, driver = supervise(1)
    crash(supervisor, 0)
    for _ in range(3):
        clock.advance(100.0)  # relaunched, then hangs past the deadline
        supervisor.exited(0)
    assert [delay for _, _, delay in driver.take_downs] == [0.5, 1.0, 2.0, 4.0]


# ---- backoff -----------------------------------------------------------------------------------------------------


def test_backoff_doubles_per_failure_of_the_same_rank_and_is_capped() -> None:
    supervisor, clock, driver = supervise(2)
    for _ in range(6):
        crash(supervisor, 0)
        clock.advance(10.0)
        supervisor.ready(0)
    crash(supervisor, 1)  # another rank's backoff is its own
    assert [delay for rank, _, delay in driver.take_downs if rank == 0] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert [delay for rank, _, delay in driver.take_downs if rank == 1] == [0.5]


def test_backoff_decays_to_the_minimum_after_a_stable_uptime() -> None:
    supervisor, clock, driver = supervise(1)
    for _ in range(3):
        crash(supervisor, 0)
        clock.advance(10.0)
        supervisor.ready(0)
    clock.advance(29.0)  # up 29 s: not yet stable
    crash(supervisor, 0)
    clock.advance(10.0)
    supervisor.ready(0)
    clock.advance(30.0)  # up 30 s: stable
    crash(supervisor, 0)
    assert [delay for _, _, delay in driver.take_downs] == [0.5, 1.0, 2.0, 4.0, 0.5]


# ---- lockstep ----------------------------------------------------------------------------------------------------


def test_lockstep_a_failure_takes_the_group_down_and_relaunches_it_once_every_process_is_gone() -> None:
    supervisor, clock, driver = supervise(3, lockstep=True)
    supervisor.failed(1, "worker exited with signal SIGKILL")
    assert [(rank, reason) for rank, reason, _ in driver.take_downs] == [
        (0, "lockstep group restart after rank 1 failed"),
        (1, "worker exited with signal SIGKILL"),
        (2, "lockstep group restart after rank 1 failed"),
    ]
    for rank in (1, 0):
        supervisor.exited(rank)
    clock.advance(1.0)
    assert len(driver.launches) == 1, "rank 2's old process is still alive"
    supervisor.exited(2)
    assert driver.launches[-1][1] == (0, 1, 2)
    supervisor.ready(0)
    supervisor.ready(2)
    assert states(supervisor) == ["starting"]
    supervisor.ready(1)
    assert states(supervisor) == ["up"]


def test_close_cancels_every_pending_restart_and_deadline() -> None:
    supervisor, clock, driver = supervise(2)
    crash(supervisor, 0)
    supervisor.close()
    clock.advance(1000.0)
    assert len(driver.launches) == 2
    supervisor.failed(1, "stopped")
    assert len(driver.take_downs) == 1

"""The one deadline mechanism and the one cancellation ledger, driven by a manual clock: nothing here sleeps or
reads the wall clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from backends.cancellation import TaskCancel
from backends.deadlines import Deadline, DeadlineExpired


class Timer:
    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """TEST DOUBLE of ``backends.deadlines.Clock``: time moves only when the test calls ``advance``, which runs the
    timers that came due, as the event loop would."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(when, callback)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.armed() if t.when <= self.now]
        for timer in due:
            self.timers.remove(timer)
            timer.callback()


class Waiting:
    """A wait the test ends by hand, which tells when the task is suspended in it."""

    def __init__(self) -> None:
        self.future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.entered = asyncio.Event()

    async def __call__(self) -> str:
        self.entered.set()
        return await self.future


async def bounded_in_task(deadline: Deadline, wait: Waiting) -> asyncio.Task[str]:
    task = asyncio.create_task(deadline.bounded(wait))
    await wait.entered.wait()  # the task now waits on ``wait.future``
    return task


async def test_a_silent_wait_ends_with_the_idle_limit_and_its_wait_is_cancelled() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    clock.advance(4.9)
    assert not task.done() and not wait.future.cancelled()
    clock.advance(0.2)
    with pytest.raises(DeadlineExpired, match="No output from the backend for 5 s") as raised:
        await task
    assert raised.value.total is False
    assert wait.future.cancelled(), "what the wait awaited was cancelled, so its cleanup ran"


async def test_outputs_restart_the_idle_limit_with_one_timer_re_armed_lazily() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    for _ in range(3):  # outputs come every 3 s (a whole response's events, each touching the deadline)
        clock.advance(3.0)
        deadline.touch()
        assert len(clock.armed()) == 1, "an output only records its time; at most one timer runs"
    assert not task.done()
    clock.advance(5.0)
    with pytest.raises(DeadlineExpired):
        await task


async def test_the_total_limit_holds_whatever_the_outputs() -> None:
    clock = ManualClock()
    deadline = Deadline(10.0, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    for _ in range(3):
        clock.advance(4.0)
        deadline.touch()
    with pytest.raises(DeadlineExpired, match="longer than its 10 s deadline") as raised:
        await task
    assert raised.value.total is True


async def test_an_absolute_end_sooner_than_the_total_wins() -> None:
    clock = ManualClock()
    deadline = Deadline(60.0, None, end=clock.now + 2.0, clock=clock)
    assert deadline.next() == clock.now + 2.0


async def test_a_wait_that_completes_returns_its_value_and_restarts_the_idle_limit() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    clock.advance(4.0)
    wait.future.set_result("event")
    assert await task == "event"
    assert deadline.next() == clock.now + 5.0


async def test_a_deadline_that_passed_between_waits_fails_the_next_wait_without_starting_it() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    assert await deadline.bounded(lambda: _value("first")) == "first"
    clock.advance(6.0)  # the timer fires while nothing waits: it cancels nothing
    started: list[str] = []

    async def second() -> str:
        started.append("second")
        return "second"

    with pytest.raises(DeadlineExpired):
        await deadline.bounded(second)
    assert started == []


async def test_a_timer_that_fires_between_waits_cancels_nothing_and_the_next_wait_re_arms_it() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    assert await deadline.bounded(lambda: _value("first")) == "first"
    clock.advance(4.0)
    deadline.touch()  # an output came outside a wait
    clock.advance(1.5)  # the first timer fires, finds nothing waiting
    assert clock.armed() == []
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    assert len(clock.armed()) == 1
    clock.advance(3.6)
    with pytest.raises(DeadlineExpired):
        await task


async def test_another_cause_s_cancellation_goes_on_as_a_cancellation() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    task.cancel()  # the client left, or the server stops
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_when_the_deadline_and_another_cause_both_cancel_the_other_cause_wins() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    clock.advance(6.0)  # the deadline cancels the task...
    task.cancel()  # ...and so does the server, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_closing_a_deadline_stops_its_timer() -> None:
    clock = ManualClock()
    deadline = Deadline(None, 5.0, clock=clock)
    wait = Waiting()
    task = await bounded_in_task(deadline, wait)
    wait.future.set_result("done")
    await task
    deadline.close()
    assert clock.armed() == []


async def test_no_limit_means_no_timer() -> None:
    clock = ManualClock()
    deadline = Deadline(None, None, clock=clock)
    assert await deadline.bounded(lambda: _value("x")) == "x"
    assert clock.timers == [] and deadline.next() is None


# --- the cancellation ledger ----------------------------------------------------------------------------------------


async def test_a_cause_claims_its_own_cancellation_and_withdraws_it() -> None:
    ready = asyncio.Event()

    async def waits() -> str:
        ready.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError as exc:
            return f"claimed={cause.claim(exc)} cancelling={task.cancelling()}"
        return "not cancelled"

    task = asyncio.create_task(waits())
    cause = TaskCancel(task)  # type: ignore[arg-type]
    await ready.wait()
    cause.cancel()
    cause.cancel()  # once per cause, however often it asks
    assert await task == "claimed=True cancelling=0"


async def test_a_cancellation_a_cause_did_not_send_is_not_its_own() -> None:
    ready = asyncio.Event()

    async def waits() -> bool:
        ready.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError as exc:
            return cause.claim(exc)
        return True

    task = asyncio.create_task(waits())
    cause = TaskCancel(task)  # type: ignore[arg-type]
    await ready.wait()
    task.cancel()
    assert await task is False
    assert not cause.claim(ValueError()), "only a cancellation can be a cause's"


async def test_nested_causes_claim_in_turn_each_withdrawing_only_its_own() -> None:
    ready = asyncio.Event()

    async def waits() -> tuple[bool, bool, int]:
        ready.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError as exc:
            return second.claim(exc), first.claim(exc), task.cancelling()
        return False, False, -1

    task = asyncio.create_task(waits())
    first, second = TaskCancel(task), TaskCancel(task)  # type: ignore[arg-type]
    await ready.wait()
    first.cancel()
    second.cancel()
    # the inner wait's cause claims first (nothing was sent after it), then the outer's: the task is whole again
    assert await task == (True, True, 0)


async def _value(value: str) -> str:
    return value

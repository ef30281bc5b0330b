"""A request's time limits over its waits for output: the one deadline mechanism of the gateway and its backends.

A request may be given a total time (from its arrival to its last output) and an idle limit (the longest silence
between two outputs). Both are checked only while the request waits for output (:meth:`Deadline.bounded`), never
while the gateway writes to its client, which has a stall limit of its own. A long stream costs one timer at a
time, re-armed lazily: an output only records when it came, and the timer, when it fires, looks at whether the
limit really passed. Time and timers come from an injected :class:`Clock` (the event loop by default), so tests
drive a deadline without waiting. The task waiting is cancelled through :class:`backends.cancellation.TaskCancel`,
and the cancellation is turned into :class:`DeadlineExpired`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from backends.cancellation import TaskCancel
from backends.errors import BackendTimeoutError

T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time and timers; ``asyncio.AbstractEventLoop`` is one."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


class DeadlineExpired(BackendTimeoutError):
    """A wait ran past its deadline; ``total``: the total time ran out (else the idle limit did)."""

    def __init__(self, message: str, *, total: bool) -> None:
        super().__init__(message)
        self.total = total


class Deadline:
    """A total end (``total`` seconds from now, or the absolute ``end`` on ``clock``, whichever is sooner) and an
    ``idle`` limit that restarts whenever a bounded wait completes or :meth:`touch` is called."""

    __slots__ = ("_cancel", "_clock", "_end", "_idle", "_last", "_timer", "_total", "_waiting")

    def __init__(
        self, total: float | None, idle: float | None, *, end: float | None = None, clock: Clock | None = None
    ) -> None:
        self._clock: Clock = clock if clock is not None else asyncio.get_running_loop()
        now = self._last = self._clock.time()
        self._total = total
        if total:
            end = now + total if end is None else min(end, now + total)
        self._end = end
        self._idle = idle or None
        self._timer: Timer | None = None
        self._waiting = False
        self._cancel: TaskCancel | None = None

    def touch(self) -> None:
        """An output came: the idle limit starts again."""
        self._last = self._clock.time()

    def next(self) -> float | None:
        """When the deadline passes if nothing more comes (None: never)."""
        end = self._end
        if self._idle is None:
            return end
        idle_end = self._last + self._idle
        return idle_end if end is None or idle_end < end else end

    def expired(self) -> DeadlineExpired:
        """The error of a wait that ran past this deadline."""
        if self._end is not None and self._clock.time() >= self._end:
            limit = f"its {self._total:g} s deadline" if self._total else "its deadline"
            return DeadlineExpired(f"The request took longer than {limit}.", total=True)
        return DeadlineExpired(f"No output from the backend for {self._idle:g} s.", total=False)

    async def bounded(self, wait: Callable[[], Awaitable[T]]) -> T:
        """``await wait()``, or :class:`DeadlineExpired` once the deadline passes while it waits (the wait is
        cancelled, so whatever it awaited cleans up as on any cancellation). Its end restarts the idle limit."""
        clock = self._clock
        at = self.next()
        if at is not None and at <= clock.time():
            raise self.expired()  # it passed while the caller did something else (wrote to its client)
        if at is not None and self._timer is None:
            self._timer = clock.call_at(at, self._check)
        task = asyncio.current_task()
        cancel = self._cancel
        if cancel is None or cancel.task is not task:
            assert task is not None, "a deadline bounds a task's waits"
            cancel = self._cancel = TaskCancel(task)
        self._waiting = True
        try:
            result = await wait()
        except asyncio.CancelledError as exc:
            if cancel.claim(exc):
                raise self.expired() from None
            raise
        finally:
            self._waiting = False
        self._last = clock.time()
        return result

    def close(self) -> None:
        """Stops the timer: nothing waits any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if not self._waiting:
            return  # the next bounded wait arms it again
        at = self.next()
        if at is not None and at > self._clock.time():
            self._timer = self._clock.call_at(at, self._check)
        elif self._cancel is not None:
            self._cancel.cancel()

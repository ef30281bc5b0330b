"""A request's deadlines: its total time and the longest silence between two of its backend's events, over the
waits for the backend (never over a send to the client: that is the stall timeout's), with as few timers as a long
stream can have (one per stream, re-armed lazily)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from backends.errors import BackendTimeoutError
from backends.interface import Event

T = TypeVar("T")


class Timeouts(NamedTuple):
    total: float | None  # seconds from arrival to the last token
    idle: float | None  # seconds between two events (the first token included)
    stall: float | None = None  # seconds one send to a streaming client may block before the stream is stopped


class Deadline:
    """A request's deadline: its total deadline, or ``idle`` after the last event, whichever comes first."""

    __slots__ = ("_end", "_idle", "_timeouts", "last", "loop")

    def __init__(self, timeouts: Timeouts) -> None:
        self.loop = asyncio.get_running_loop()
        self._timeouts = timeouts
        now = self.loop.time()
        self._end = now + timeouts.total if timeouts.total else None
        self._idle = timeouts.idle
        self.last = now

    def next(self) -> float | None:
        idle_end = self.last + self._idle if self._idle else None
        if self._end is None:
            return idle_end
        return self._end if idle_end is None else min(self._end, idle_end)

    def touch(self) -> None:
        """An event came: the idle part of the deadline starts again."""
        self.last = self.loop.time()

    def expired(self) -> BackendTimeoutError:
        if self._end is not None and self.loop.time() >= self._end:
            return BackendTimeoutError(f"The request took longer than its {self._timeouts.total:g} s deadline.")
        return BackendTimeoutError(f"No output from the backend for {self._timeouts.idle:g} s.")


class Expiry:
    """The request's deadline over many waits at once (a whole response): one timer, re-armed lazily. An event
    only moves ``deadline.last``; when the timer fires it checks whether the deadline really passed, and re-arms at
    the later one if not. Expiry goes through an ``asyncio.Timeout`` (cancel the task, then ``TimeoutError``),
    so its bookkeeping of cancellations is asyncio's own, and is raised as the deadline's ``BackendTimeoutError``.
    """

    __slots__ = ("_deadline", "_handle", "_scope")

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self._scope = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        await self._scope.__aenter__()
        at = self._deadline.next()
        if at is not None:
            self._handle = self._deadline.loop.call_at(at, self._check)

    def _check(self) -> None:
        at = self._deadline.next()
        now = self._deadline.loop.time()
        if at is not None and at > now:
            self._handle = self._deadline.loop.call_at(at, self._check)
        else:
            self._handle = None
            self._scope.reschedule(now)  # expires the scope now: it cancels the task

    async def __aexit__(self, kind: Any, exc: Any, traceback: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        try:
            await self._scope.__aexit__(kind, exc, traceback)
        except TimeoutError:
            raise self._deadline.expired() from None


class WaitDeadline:
    """The request's deadline over a stream's waits for the backend, frame after frame: one timer for the whole
    stream, re-armed lazily (a wait only records its end), that cancels the task only while it waits for the
    backend, never during a send to the client (that is the stall timeout's). A timer firing during a wait finds
    the task suspended in it, so the cancellation lands there; an ``asyncio.timeout`` per wait cost a timer, a
    cancellation and a scope per frame."""

    __slots__ = ("_cancelling", "_deadline", "_expired", "_handle", "_task", "_waiting")

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._waiting = False
        self._expired = False
        self._cancelling = 0

    def _arm(self) -> None:
        at = self._deadline.next()
        self._handle = None if at is None else self._deadline.loop.call_at(at, self._check)

    def _check(self) -> None:
        self._handle = None
        if not self._waiting:
            return  # the next wait arms it again
        at = self._deadline.next()
        if at is not None and at > self._deadline.loop.time():
            self._arm()
            return
        self._expired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    async def wait(self, wait: Callable[[], Awaitable[T]]) -> T:
        """``wait()``, bounded by the deadline (``BackendTimeoutError``, as ``within``)."""
        deadline = self._deadline
        at = deadline.next()
        if at is not None and at <= deadline.loop.time():
            raise deadline.expired()  # it passed while the frames before were being sent
        if self._handle is None and at is not None:
            self._handle = deadline.loop.call_at(at, self._check)
        self._waiting = True
        try:
            event = await wait()
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if self._task.uncancel() <= self._cancelling:
                    raise deadline.expired() from None
            raise
        finally:
            self._waiting = False
        deadline.last = deadline.loop.time()
        return event

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def next_event(events: AsyncIterator[Event], deadline: Deadline | None) -> Event:
    """The next event, or ``BackendTimeoutError`` once the deadline passes (the backend's work is aborted,
    since the timeout cancels the iterator's pending await and its cleanup runs). The timeout only ever spans
    the wait for the backend, never a send to the client."""
    return await within(deadline, lambda: anext(events))


async def within(deadline: Deadline | None, wait: Callable[[], Awaitable[Event]]) -> Event:
    """``wait()``, bounded by the request's deadline (see ``next_event``)."""
    if deadline is None:
        return await wait()
    at = deadline.next()
    if at is None:
        event = await wait()
    else:
        try:
            async with asyncio.timeout_at(at):
                event = await wait()
        except TimeoutError:
            raise deadline.expired() from None
    deadline.last = deadline.loop.time()
    return event

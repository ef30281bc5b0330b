"""Reading an event stream in bursts: every event that is ready without waiting, then one wait.

What it does. A stream is written to its client once per burst rather than once per event: when several upstream
chunks arrived in one network read, or a request's queue filled while the event loop was busy, their frames go out
in one write (``gateway.streaming`` joins them, up to 64 frames). :meth:`BurstReader.ready` finds out whether the
next event is ready by running the iterator's ``__anext__`` step by hand up to its first suspension: if the step
completes, the event was ready; if it suspends, the started step is kept with the future it yielded, and
:meth:`BurstReader.wait` finishes it under the caller's task, so its deadline and cancellation reach the backend
as they would through a plain ``await``. ``resume`` does the same for ``gateway.sse``'s sends.

The asyncio contract (also spelled out in ``gateway.sse``). A coroutine that suspends yields a future to the Task
that drives it. ``_Resume`` "re-yields the future to the Task": its ``__await__`` yields the future the hand step
handed out, unchanged, so the Task waits on it as on any ``await``; whatever the Task then sends or throws in (the
future's result, a cancellation) is passed on to the stepped coroutine, until it returns. This is what ``await``
itself does one frame at a time, so the Task cannot tell the difference. It holds as long as the first step ran in
the same Task as the rest (it does: ``ready`` is called from the request's own code), and a started step is never
dropped: :meth:`BurstReader.aclose` throws ``CancelledError`` into it, as a cancelled ``await`` would, so the
backend's cleanup (aborting its work) runs before the iterator is closed.

Why not a plain ``async for``: measured with ``bench/gateway_overhead.py --stream-variants`` (issue 25; the table
is in the README, "Why not sse-starlette"), Starlette's ``StreamingResponse`` writing one frame per event used a
median 1.17x this gateway's CPU per streamed request (0.95x-1.39x), and with this reader in front of it
0.93x-1.35x (the noise of a shared machine; these runs do not tell the reader's share apart more finely).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Resume(Generic[T]):
    """Awaits a coroutine that already ran up to a suspension point (it yielded ``pending`` to its task), or
    with ``throw``, throws that into it first (in place of the result ``pending`` would have brought)."""

    __slots__ = ("_coro", "_pending", "_throw")

    def __init__(self, coro: Coroutine[Any, Any, T], pending: Any, throw: BaseException | None = None) -> None:
        self._coro = coro
        self._pending = pending
        self._throw = throw

    def __await__(self) -> Generator[Any, Any, T]:
        coro, pending = self._coro, self._pending
        if self._throw is not None:
            try:
                pending = coro.throw(self._throw)
            except StopIteration as done:
                return done.value
        while True:
            try:
                value = yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation and the like go on to the coroutine
                try:
                    pending = coro.throw(exc)
                except StopIteration as done:
                    return done.value
                continue
            try:
                pending = coro.send(value)
            except StopIteration as done:
                return done.value


def resume(coro: Coroutine[Any, Any, T], pending: Any) -> Awaitable[T]:
    """Awaits ``coro``, which already ran by hand up to a suspension point where it yielded ``pending``."""
    return _Resume(coro, pending)


class BurstReader(Generic[T]):
    """Pulls items from an async iterator, telling the ready ones (:meth:`ready`) from a wait (:meth:`wait`)."""

    __slots__ = ("_events", "_pending", "_step")

    def __init__(self, events: AsyncIterator[T]) -> None:
        self._events = events
        self._step: Coroutine[Any, Any, T] | None = None
        self._pending: Any = None

    def ready(self) -> T | None:
        """The next item if the iterator gives it without waiting (``StopAsyncIteration`` at its end); None when
        it has to wait, and then :meth:`wait` gives it. Items are never None."""
        step: Coroutine[Any, Any, T] = self._events.__anext__()  # type: ignore[assignment]
        try:
            pending = step.send(None)
        except StopIteration as done:
            return done.value
        self._step, self._pending = step, pending
        return None

    def wait(self) -> Awaitable[T]:
        """The item :meth:`ready` could not give without waiting (an awaitable, not a coroutine: one frame less
        between the stream and its backend on every wake-up)."""
        step, pending = self._step, self._pending
        assert step is not None, "wait() without a pending ready()"
        self._step = self._pending = None
        return _Resume(step, pending)

    async def aclose(self) -> None:
        """Ends a step left waiting (it sees the cancellation a plain ``await`` would have seen, so the backend's
        cleanup runs), then closes the iterator."""
        step, pending = self._step, self._pending
        if step is not None:
            self._step = self._pending = None
            if isinstance(pending, asyncio.Future):
                pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # the stream is over: its cleanup mattered
                await _Resume(step, None, asyncio.CancelledError())
        await self._events.aclose()  # type: ignore[attr-defined]

"""Event streams: what ``generate`` returns, the synchronous view some offer (``PolledStream``), and running several
at once (n choices, several prompts) as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol, TypeVar, cast, runtime_checkable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EventStream(Protocol[T_co]):
    """An async iterator its consumer closes early (``aclose``) to abort the work behind it: what ``generate``
    returns (an async generator, or a wrapper such as the admission gate's that frees its slot on close)."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Awaitable[object]: ...


class EventPoller(Protocol[T_co]):
    """A stream's events as they are ready, without a coroutine per event: ``poll()`` returns the next event, or
    None when none is ready yet, and raises ``StopAsyncIteration`` at the stream's end or the error that ends it.
    The stream is still closed with its ``aclose``; after ``poll`` raised, it only raises ``StopAsyncIteration``.
    ``arrival()`` is done once ``poll`` may have an event: already done when it may now (events can come while the
    consumer, having seen None, writes what it had), else when one comes."""

    def poll(self) -> T_co | None: ...

    def arrival(self) -> Awaitable[None]: ...

    def listen(self, listener: Callable[[], None] | None) -> bool:
        """Calls ``listener`` synchronously each time an event may have become ready (where ``arrival`` would
        complete), until ``listen(None)``; False, and nothing changes, if ``poll`` may have an event now or the
        stream cannot notify this way (then use ``arrival``). The listener must not raise."""
        ...


@runtime_checkable
class PolledStream(Protocol[T_co]):
    """Optional capability of an event stream whose events wait in a local queue (the engine backends' steps):
    ``poller()`` is its synchronous view, from the first event on, or None where it has none (yet). A consumer
    that pulls many events (a stream's frames) then spends one call per event instead of an ``await`` chain."""

    def poller(self) -> EventPoller[T_co] | None: ...


_CONFORMS: dict[tuple[type, object], bool] = {}


def conforms(obj: object, protocol: object) -> bool:
    """``isinstance(obj, protocol)`` for a runtime-checkable protocol whose members are class members, answered
    once per class: such an ``isinstance`` inspects every member of the protocol on each call (tens of
    microseconds on Python 3.11), too slow for every request."""
    key = (type(obj), protocol)
    known = _CONFORMS.get(key)
    if known is None:
        known = _CONFORMS[key] = isinstance(obj, cast("type", protocol))
    return known


def poller_of(stream: object) -> EventPoller[T] | None:
    """The stream's synchronous view, if it offers one now."""
    return cast("PolledStream[T]", stream).poller() if conforms(stream, PolledStream) else None


async def interleave(streams: Sequence[EventStream[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yields ``(stream index, item)`` as items arrive from streams running concurrently.

    The first error of any stream is raised here; however the merged stream ends, every stream is cancelled and
    closed, so their cleanup (aborting engine or upstream work) always runs.
    """
    queue: asyncio.Queue[tuple[int, T | None, Exception | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: EventStream[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None, False))
        except Exception as exc:
            queue.put_nowait((index, None, exc, True))
        else:
            queue.put_nowait((index, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error, ended = await queue.get()
            if error is not None:
                raise error
            if ended:
                remaining -= 1
            else:
                yield index, cast(T, item)  # neither an error nor the end: one of the stream's items
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

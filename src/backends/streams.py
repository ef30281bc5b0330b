"""Event streams: what ``generate`` returns, how a consumer reads one a batch at a time (``BatchStream``), and
running several at once (n choices, several prompts) as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EventStream(Protocol[T_co]):
    """An async iterator its consumer closes early (``aclose``) to abort the work behind it: what ``generate``
    returns (an async generator, or a wrapper such as the admission gate's that frees its slot on close)."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Awaitable[object]: ...


@runtime_checkable
class BatchStream(Protocol[T]):
    """An event stream read a batch at a time: the one contract between a backend's stream and its consumer.

    - ``ready()`` returns every event that is ready now, in order, without waiting: possibly none (``[]``). It
      raises the stream's error, or ``StopAsyncIteration`` at its end, once the events before were returned.
    - ``wait()`` is done once ``ready()`` may have more (at once, if events came meanwhile). It raises nothing but
      a cancellation: errors come from ``ready()``.

    So a consumer loops: take the ready batch, handle it, wait. The first event is taken with ``__anext__``, which
    opens the stream (admission, routing's fallbacks); the batch methods read what follows, and the stream is still
    closed with ``aclose``. A wrapper forwards both methods to its inner stream's batches (``batches_of``), looking
    at each event of a batch if it must. A backend whose events wait in a local queue offers its own; any other
    stream is read one event per wait (:class:`OneByOne`).
    """

    def ready(self) -> list[T]: ...

    def wait(self) -> Awaitable[None]: ...


@runtime_checkable
class Notifying(Protocol):
    """A ``BatchStream`` whose producer can say synchronously that ``ready()`` may have more, instead of through
    the future ``wait()`` returns: no future and no event-loop callback per engine step, which a stream pays on
    every step it waits (the consumer renders and writes the step's frames from the producer's call).

    ``notify(callback)`` returns True when ``callback`` will be called once, from the producer's own code on the
    event loop, as soon as ``ready()`` may have more; False when it will not be (events are ready already, or
    this stream cannot tell): then the consumer uses ``wait()``. A later ``notify`` replaces an earlier one.
    ``callback`` must not raise. A wrapper forwards its inner stream's ``notify`` (or ``never_notifies``).
    """

    def notify(self, callback: Callable[[], None]) -> bool: ...


def never_notifies(callback: Callable[[], None]) -> bool:
    """``Notifying.notify`` of a stream that cannot notify: its consumer always uses ``wait()``."""
    return False


def notify_of(batches: BatchStream[Any]) -> Callable[[Callable[[], None]], bool]:
    """The batches' ``notify`` if they offer it, else ``never_notifies``."""
    return cast("Notifying", batches).notify if conforms(batches, Notifying) else never_notifies


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


def batches_of(stream: EventStream[T]) -> BatchStream[T]:
    """The stream's own batches if it offers them, else its events one per wait."""
    if conforms(stream, BatchStream):
        return cast("BatchStream[T]", stream)
    return OneByOne(stream)


class OneByOne(Generic[T]):
    """A ``BatchStream`` over an event stream that has no batches of its own: each wait takes one event."""

    __slots__ = ("_done", "_events", "_failed", "_held")

    def __init__(self, events: EventStream[T]) -> None:
        self._events = events
        self._held: list[T] = []
        self._done = False  # the stream ended well: ``ready`` raises a new StopAsyncIteration
        self._failed: Exception | None = None  # the error the stream ended with, raised by ``ready``
        # (Not the caught StopAsyncIteration itself: its traceback holds ``wait``'s frame and so this object, a
        # reference cycle for every stream that ends.)

    def ready(self) -> list[T]:
        held = self._held
        if held:
            self._held = []
            return held
        if self._done:
            raise StopAsyncIteration
        if self._failed is not None:
            raise self._failed
        return held

    async def wait(self) -> None:
        if self._held or self._done or self._failed is not None:
            return
        try:
            self._held = [await self._events.__anext__()]
        except StopAsyncIteration:
            self._done = True
        except Exception as exc:  # ``ready`` raises it
            self._failed = exc


class _NotOpened:
    """The batches of a stream whose first event was not taken yet: a consumer's mistake."""

    def ready(self) -> list[Any]:
        raise RuntimeError("take a stream's first event with __anext__ before reading its batches")

    def wait(self) -> Awaitable[None]:
        raise RuntimeError("take a stream's first event with __anext__ before reading its batches")


NOT_OPENED: BatchStream[Any] = _NotOpened()
"""What a wrapper's batches are until its inner stream opened."""


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

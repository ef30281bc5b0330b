"""Where one request's engine outputs wait for its client: bounded, so a client that does not read cannot make the
gateway hold more than a fixed number of tokens for it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, SlowClientError

Item = tuple[int, Sequence[EngineOutput] | BackendError]


class OutputBuffer:
    """A FIFO of ``(choice index, step outputs or terminal error)`` fed by the engine driver's sink.

    When more than ``limit`` tokens wait, the buffer drops them, calls ``on_overflow`` (which aborts the engine
    requests, so nothing more arrives) and ends with a ``SlowClientError``: memory stays bounded whatever the
    client does. ``limit`` ``None`` means no bound.
    """

    __slots__ = ("_items", "_limit", "_listener", "_loop", "_on_overflow", "_waiter", "overflowed", "tokens")

    def __init__(self, limit: int | None, on_overflow: Callable[[], None]) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[], None] | None = None  # called once by the next put (``listen``)
        self._loop: asyncio.AbstractEventLoop | None = None  # the stream's loop, looked up once (not per wait)
        self._limit = limit
        self._on_overflow = on_overflow
        self.tokens = 0
        """Tokens waiting now."""
        self.overflowed = False

    def put(self, index: int, item: Sequence[EngineOutput] | BackendError) -> None:
        """The driver's sink (on the event loop)."""
        if self.overflowed:
            return
        if not isinstance(item, BackendError):
            self.tokens += len(item)
            if self._limit is not None and self.tokens > self._limit:
                self.overflowed = True
                self._items.clear()
                self.tokens = 0
                item = SlowClientError(
                    f"The client fell more than {self._limit} tokens behind its stream; the request was stopped."
                )
                self._on_overflow()
        self._items.append((index, item))
        listener = self._listener
        if listener is not None:
            self._listener = None
            listener()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def pop(self) -> Item | None:
        """The oldest item, or None when none waits (then ``arrival()`` says when one does)."""
        items = self._items
        if not items:
            return None
        index, item = items.popleft()
        if not isinstance(item, BackendError):
            self.tokens -= len(item)
        return index, item

    def listen(self, listener: Callable[[], None]) -> bool:
        """Has the next ``put`` call ``listener`` (once, synchronously, after it stored its item); False if an
        item waits already (then nothing is called). It replaces an earlier listener."""
        if self._items:
            return False
        self._listener = listener
        return True

    def unlisten(self) -> None:
        """Drops the listener ``listen`` set, if no ``put`` has called it: its reader stopped waiting (the listener
        would otherwise keep that reader, and whatever holds this buffer, alive in a reference cycle)."""
        self._listener = None

    def arrival(self) -> asyncio.Future[None]:
        """Done once an item waits: at once if one does (it may have come since the caller's last ``pop``, while
        it wrote to its client), else when the next is put. Awaited straight from the stream's own frame (no
        coroutine per wait)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        if self._items:
            waiter.set_result(None)
        else:
            self._waiter = waiter
        return waiter

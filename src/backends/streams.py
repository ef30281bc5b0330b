"""Running several event streams at once (n choices, several prompts) as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Protocol, TypeVar, cast

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EventStream(Protocol[T_co]):
    """An async iterator its consumer closes early (``aclose``) to abort the work behind it: what ``generate``
    returns (an async generator, or a wrapper such as the admission gate's that frees its slot on close)."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Awaitable[object]: ...


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

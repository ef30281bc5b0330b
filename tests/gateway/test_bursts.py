"""BurstReader: ready items come without waiting, a wait keeps its deadline and cancellation, closing aborts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.bursts import BurstReader


class Source:
    """An async generator that yields what is queued and waits on a future when the queue is empty."""

    def __init__(self) -> None:
        self.queued: list[int] = []
        self.gate: asyncio.Future[None] | None = None
        self.cleanup: list[str] = []

    async def events(self) -> AsyncIterator[int]:
        try:
            while True:
                while self.queued:
                    item = self.queued.pop(0)
                    if item < 0:
                        raise ValueError(f"bad item {item}")
                    yield item
                self.gate = asyncio.get_running_loop().create_future()
                await self.gate
                if not self.queued:
                    return
        except BaseException as exc:
            self.cleanup.append(type(exc).__name__)
            raise
        finally:
            self.cleanup.append("finally")

    def push(self, *items: int) -> None:
        self.queued.extend(items)
        assert self.gate is not None
        self.gate.set_result(None)


async def test_ready_items_then_a_wait() -> None:
    source = Source()
    source.queued = [1, 2, 3]
    reader = BurstReader(source.events())
    assert [reader.ready(), reader.ready(), reader.ready()] == [1, 2, 3]
    assert reader.ready() is None  # it has to wait now
    source.push(4, 5)
    assert await reader.wait() == 4
    assert reader.ready() == 5
    assert reader.ready() is None
    source.push()  # nothing more: the end
    with pytest.raises(StopAsyncIteration):
        await reader.wait()
    with pytest.raises(StopAsyncIteration):
        reader.ready()
    assert source.cleanup == ["finally"]


async def test_errors_come_out_of_ready_and_wait() -> None:
    source = Source()
    source.queued = [1, -1]
    reader = BurstReader(source.events())
    assert reader.ready() == 1
    with pytest.raises(ValueError, match="bad item -1"):
        reader.ready()
    source = Source()
    reader = BurstReader(source.events())
    assert reader.ready() is None
    source.push(-2)
    with pytest.raises(ValueError, match="bad item -2"):
        await reader.wait()


async def test_a_deadline_on_the_wait_cancels_the_source() -> None:
    source = Source()
    reader = BurstReader(source.events())
    assert reader.ready() is None
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout_at(loop.time()):  # already due: fires while the source waits
            await reader.wait()
    assert source.cleanup == ["CancelledError", "finally"]


async def test_closing_a_waiting_reader_aborts_the_source() -> None:
    source = Source()
    source.queued = [1]
    reader = BurstReader(source.events())
    assert reader.ready() == 1
    assert reader.ready() is None
    assert source.gate is not None
    await reader.aclose()
    assert source.cleanup == ["CancelledError", "finally"]
    assert source.gate.cancelled()


async def test_closing_an_idle_reader_closes_the_source() -> None:
    source = Source()
    source.queued = [1, 2]
    reader = BurstReader(source.events())
    assert reader.ready() == 1
    await reader.aclose()
    assert source.cleanup == ["GeneratorExit", "finally"]

"""interleave: several streams as one, and every stream closed however the merged one ends; the batch contract's
adapter for streams without batches of their own."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable

import pytest

from backends.streams import NOT_OPENED, OneByOne, batches_of, interleave


class Tracked:
    """An async stream that records whether its cleanup ran."""

    def __init__(self, items: list[int], fail_after: int | None = None, delay: float = 0.0) -> None:
        self.items, self.fail_after, self.delay, self.closed = items, fail_after, delay, False

    async def run(self) -> AsyncIterator[int]:
        try:
            for count, item in enumerate(self.items):
                if self.fail_after is not None and count == self.fail_after:
                    raise ValueError("stream failed")
                await asyncio.sleep(self.delay)
                yield item
        finally:
            self.closed = True


async def test_items_of_every_stream_arrive_tagged_with_their_stream() -> None:
    a, b = Tracked([1, 2, 3]), Tracked([10, 20])
    got = [pair async for pair in interleave([a.run(), b.run()])]
    assert sorted(got) == [(0, 1), (0, 2), (0, 3), (1, 10), (1, 20)]
    assert [item for index, item in got if index == 0] == [1, 2, 3], "order within a stream is kept"
    assert a.closed and b.closed


async def test_an_error_in_one_stream_is_raised_and_the_others_are_closed() -> None:
    failing, slow = Tracked([1, 2, 3], fail_after=1), Tracked(list(range(100)), delay=0.01)
    with pytest.raises(ValueError, match="stream failed"):
        async for _ in interleave([failing.run(), slow.run()]):
            pass
    assert slow.closed


async def test_closing_the_merged_stream_early_closes_every_stream() -> None:
    a, b = Tracked(list(range(100)), delay=0.01), Tracked(list(range(100)), delay=0.01)
    merged = interleave([a.run(), b.run()])
    await anext(merged)
    await merged.aclose()
    assert a.closed and b.closed


# --- the batch contract ---------------------------------------------------------------------------------------------


async def test_a_stream_without_batches_of_its_own_is_read_one_event_per_wait() -> None:
    source = Tracked([1, 2, 3])
    batches = batches_of(source.run())
    assert isinstance(batches, OneByOne)
    got: list[int] = []
    while True:
        try:
            batch = batches.ready()
        except StopAsyncIteration:
            break
        got.extend(batch)
        if not batch:
            await batches.wait()
    assert got == [1, 2, 3]


async def test_a_stream_read_one_by_one_to_its_end_leaves_no_reference_cycle(collected_garbage: list[object]) -> None:
    """An LMDeploy stream, say: what reads it is freed as it ends, not by the cycle collector."""
    batches = batches_of(Tracked([1, 2]).run())
    for item in (1, 2):
        await batches.wait()
        assert batches.ready() == [item]
    for _ in range(2):  # the end, read twice
        await batches.wait()
        with pytest.raises(StopAsyncIteration):
            batches.ready()
    del batches
    gc.collect()
    assert not [thing for thing in collected_garbage if isinstance(thing, OneByOne)]


async def test_one_by_one_raises_the_stream_s_error_from_ready_never_from_wait() -> None:
    batches = batches_of(Tracked([1, 2], fail_after=1).run())
    await batches.wait()
    assert batches.ready() == [1]
    await batches.wait()  # the error is held, not raised here
    with pytest.raises(ValueError, match="stream failed"):
        batches.ready()


async def test_a_stream_with_batches_of_its_own_is_its_own_batches() -> None:
    class OwnBatches:
        """TEST DOUBLE of a backend's stream that offers batches."""

        def ready(self) -> list[int]:
            return [1, 2]

        def wait(self) -> Awaitable[None]:
            return asyncio.sleep(0)

        def __aiter__(self) -> OwnBatches:
            return self

        async def __anext__(self) -> int:
            raise StopAsyncIteration

        async def aclose(self) -> None:
            pass

    stream = OwnBatches()
    assert batches_of(stream) is stream


async def test_a_wrapper_s_batches_before_its_stream_opened_are_a_mistake_said_plainly() -> None:
    with pytest.raises(RuntimeError, match="first event"):
        NOT_OPENED.ready()

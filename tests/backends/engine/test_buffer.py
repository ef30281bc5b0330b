"""OutputBuffer: a client that reads is never cut off, one that does not is, and a waiting stream wakes on a put."""

from __future__ import annotations

import asyncio

from backends.engine.buffer import OutputBuffer
from backends.engine.protocol import EngineOutput
from backends.errors import SlowClientError, UpstreamError


def step(tokens: int) -> list[EngineOutput]:
    return [EngineOutput("r", 5 + i, False, "", 1 + i, 8, -0.5, (), ()) for i in range(tokens)]


def test_a_client_that_reads_every_step_never_overflows_however_many_tokens_pass() -> None:
    aborted: list[bool] = []
    buffer = OutputBuffer(8, lambda: aborted.append(True))
    for _ in range(50):  # 200 tokens through a buffer bounded at 8
        buffer.put(0, step(4))
        entry = buffer.pop()
        assert entry is not None and len(entry[1]) == 4
    assert buffer.pop() is None
    assert buffer.tokens == 0 and not aborted and not buffer.overflowed


def test_a_client_that_falls_behind_the_bound_gets_a_slow_client_error_and_the_work_is_aborted() -> None:
    aborted: list[bool] = []
    buffer = OutputBuffer(8, lambda: aborted.append(True))
    buffer.put(0, step(4))
    buffer.put(0, step(4))
    buffer.put(0, step(4))  # 12 waiting > 8
    entry = buffer.pop()
    assert entry is not None and isinstance(entry[1], SlowClientError)
    assert aborted == [True] and buffer.pop() is None
    buffer.put(0, step(4))  # late outputs after the overflow are dropped
    assert buffer.pop() is None


async def test_a_waiting_stream_wakes_when_an_item_is_put_and_errors_come_in_order() -> None:
    buffer = OutputBuffer(None, lambda: None)
    assert buffer.pop() is None
    arrival = buffer.arrival()
    asyncio.get_running_loop().call_soon(buffer.put, 1, step(2))
    await arrival
    entry = buffer.pop()
    assert entry is not None and entry[0] == 1 and len(entry[1]) == 2
    error = UpstreamError("gone")
    buffer.put(0, error)
    assert buffer.pop() == (0, error)
    assert buffer.tokens == 0


async def test_arrival_is_done_at_once_when_an_item_came_since_the_last_pop() -> None:
    """A stream that saw nothing, then wrote to its client, must not wait for a put that already happened: after
    an overflow no put ever comes again, and such a wait hung the stream with its error frame undelivered."""
    buffer = OutputBuffer(4, lambda: None)
    assert buffer.pop() is None  # nothing yet: the stream goes to write what it had
    buffer.put(0, step(4))
    buffer.put(0, step(4))  # over the bound: the error is queued, later puts are dropped
    arrival = buffer.arrival()
    assert arrival.done()
    entry = buffer.pop()
    assert entry is not None and isinstance(entry[1], SlowClientError)


def test_a_listener_is_called_once_by_the_next_put_after_its_item_is_stored() -> None:
    buffer = OutputBuffer(None, lambda: None)
    seen: list[int] = []
    assert buffer.listen(lambda: seen.append(buffer.tokens))
    assert seen == []
    buffer.put(0, step(3))
    assert seen == [3], "called synchronously by the put, with the item already there"
    buffer.put(0, step(1))
    assert seen == [3], "once: a later put does not call it again"


def test_listen_refuses_while_an_item_waits_so_the_stream_reads_it_first() -> None:
    buffer = OutputBuffer(None, lambda: None)
    seen: list[bool] = []
    buffer.put(0, step(2))
    assert not buffer.listen(lambda: seen.append(True))
    buffer.put(0, step(2))
    assert seen == []
    assert buffer.pop() is not None and buffer.pop() is not None
    assert buffer.listen(lambda: seen.append(True))


def test_an_overflow_calls_the_listener_so_the_stream_ends_with_its_error() -> None:
    buffer = OutputBuffer(4, lambda: None)
    seen: list[bool] = []
    buffer.put(0, step(4))
    assert buffer.pop() is not None
    assert buffer.listen(lambda: seen.append(True))
    buffer.put(0, step(5))  # over the bound: the error is queued and the listener told
    entry = buffer.pop()
    assert seen == [True] and entry is not None and isinstance(entry[1], SlowClientError)

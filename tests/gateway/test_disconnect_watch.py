"""DisconnectWatch on its own: the client's ``http.disconnect`` cancels the request's task, and only that
cancellation is claimed as the client's (the cancellation ledger is ``backends.cancellation.TaskCancel``)."""

from __future__ import annotations

import asyncio

from starlette.types import Message

from gateway.sse import DisconnectWatch


class Receive:
    """TEST DOUBLE of the ASGI server's ``receive`` once the request's body was read: it blocks until the test
    says the client went away."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[Message] = asyncio.Queue()

    async def __call__(self) -> Message:
        return await self.messages.get()

    def disconnect(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})


async def serve(receive: Receive, entered: asyncio.Event) -> str:
    """A request's task: waits for its backend (forever here) under a disconnect watch."""
    watch = DisconnectWatch(receive)
    entered.set()
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError as exc:
        if watch.caused(exc):
            return f"client gone, cancelling={asyncio.current_task().cancelling()}"  # type: ignore[union-attr]
        raise
    finally:
        watch.close()
    return "unreachable"


async def test_the_client_leaving_cancels_the_task_and_the_cancellation_is_withdrawn() -> None:
    receive, entered = Receive(), asyncio.Event()
    task = asyncio.create_task(serve(receive, entered))
    await entered.wait()
    receive.disconnect()
    assert await task == "client gone, cancelling=0"


async def test_a_cancellation_from_the_server_is_not_the_client_s() -> None:
    receive, entered = Receive(), asyncio.Event()
    task = asyncio.create_task(serve(receive, entered))
    await entered.wait()
    task.cancel()  # the server stops
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("a shutdown's cancellation must go on")


async def test_a_closed_watch_cancels_nothing() -> None:
    receive = Receive()
    done = asyncio.Event()

    async def request() -> str:
        watch = DisconnectWatch(receive)
        watch.close()
        receive.disconnect()  # the end of a response makes receive report a disconnect
        await done.wait()
        return "answered"

    task = asyncio.create_task(request())
    done.set()
    assert await task == "answered"

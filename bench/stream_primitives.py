"""The gateway served with another streaming primitive in place of ``gateway/sse.py`` and its batches, so
``bench/gateway_overhead.py --stream-variants`` can measure them interleaved with ours in one run.

``python bench/stream_primitives.py VARIANT serve --config FILE --port N`` swaps, in this process only, the
response class and the batches that ``gateway.streaming`` streams with, then runs the gateway's CLI. Nothing in
``src`` reads it. Variants:

- ``starlette``: Starlette's ``StreamingResponse`` plus a ping timer, one write per event (no batches): what the
  streaming path would be written as without ``sse.py`` and ``BatchStream``;
- ``starlette-batches``: the same response with our batches, to tell the two effects apart;
- ``sse-starlette``: sse-starlette's ``EventSourceResponse`` (its own pings and send timeout), one write per event;
  needs ``pip install sse-starlette`` in this environment (it is not a dependency of the project).

Each keeps the contract ``streaming.stream_response`` relies on: the disconnect watch is closed before the last
body message (the end of a response makes ``receive`` report a disconnect), a cancellation the watch caused is
withdrawn, the frames iterator is closed and ``on_end(stalled)`` called once the response is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from backends.streams import OneByOne
from gateway.sse import PING_FRAME, DisconnectWatch

VARIANTS = ("starlette", "starlette-batches", "sse-starlette")


class _StreamEnd:
    """The end of one stream as ``EventStreamResponse`` handles it, shared by the alternative responses."""

    def __init__(self, content: AsyncIterator[bytes], watch: DisconnectWatch, on_end: Callable[[bool], None]) -> None:
        self.content = content
        self.watch = watch
        self.on_end = on_end

    def closing_send(self, send: Send) -> Send:
        """``send`` that closes the disconnect watch before the response's last message."""

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.watch.close()
            await send(message)

        return closing

    async def finish(self, stalled: bool) -> None:
        self.watch.close()
        await self.content.aclose()
        self.on_end(stalled)


class StarletteEventStream(StreamingResponse):
    """Starlette's ``StreamingResponse`` of the frames, a ping timer beside it, ``asyncio.timeout`` per send."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        watch: DisconnectWatch,
        on_end: Callable[[bool], None],
        *,
        headers: dict[str, str],
        ping_seconds: float | None,
        stall_timeout: float | None,
        ping_frame: bytes = PING_FRAME,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        self._end = _StreamEnd(content, watch, on_end)
        self._ping_seconds = ping_seconds
        self._ping_frame = ping_frame
        self._stall_timeout = stall_timeout
        self._last_write = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        stall = self._stall_timeout
        inner = self._end.closing_send(send)

        async def timed_send(message: Message) -> None:
            if stall is None:
                await inner(message)
            else:
                async with asyncio.timeout(stall):
                    await inner(message)
            self._last_write = loop.time()

        pings: set[asyncio.Task[None]] = set()

        def ping_due() -> None:
            nonlocal timer
            interval = self._ping_seconds
            assert interval
            idle = loop.time() - self._last_write
            if idle >= interval:
                task = loop.create_task(self._ping(send))
                pings.add(task)
                task.add_done_callback(pings.discard)
                idle = 0.0
            timer = loop.call_later(interval - idle, ping_due)

        self._last_write = loop.time()
        timer = loop.call_later(self._ping_seconds, ping_due) if self._ping_seconds else None
        stalled = False
        try:
            await super().__call__(scope, receive, timed_send)
        except TimeoutError:
            stalled = True
        except asyncio.CancelledError as exc:
            if not self._end.watch.caused(exc):
                raise
        finally:
            if timer is not None:
                timer.cancel()
            for task in pings:
                task.cancel()
            await self._end.finish(stalled)

    def write_now(self, chunk: bytes) -> bool:
        """What ``gateway.streaming`` asks of a response: a direct write. None here, so every frame goes out as
        this primitive streams its content."""
        return False

    async def _ping(self, send: Send) -> None:
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": self._ping_frame, "more_body": True})
            self._last_write = asyncio.get_running_loop().time()


def sse_starlette_response() -> type[Any]:
    """sse-starlette's ``EventSourceResponse`` behind ``EventStreamResponse``'s constructor (imported late: it is
    installed only for the bench)."""
    from sse_starlette.sse import EventSourceResponse, ServerSentEvent

    class SseStarletteEventStream(EventSourceResponse):
        """``EventSourceResponse`` of the frames (bytes go out as they are), its pings and its send timeout."""

        def __init__(
            self,
            content: AsyncIterator[bytes],
            watch: DisconnectWatch,
            on_end: Callable[[bool], None],
            *,
            headers: dict[str, str],
            ping_seconds: float | None,
            stall_timeout: float | None,
            ping_frame: bytes = PING_FRAME,
        ) -> None:
            comment = ping_frame.decode().removeprefix(": ").strip()
            super().__init__(
                content,
                headers=headers,
                ping=int(ping_seconds) if ping_seconds else 10**9,
                ping_message_factory=lambda: ServerSentEvent(comment=comment),
                send_timeout=stall_timeout,
            )
            self._end = _StreamEnd(content, watch, on_end)

        def write_now(self, chunk: bytes) -> bool:
            """What ``gateway.streaming`` asks of a response: a direct write. None here, so every frame goes out as
            this primitive streams its content."""
            return False

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            stalled = False
            try:
                await super().__call__(scope, receive, self._end.closing_send(send))
            except TimeoutError:
                stalled = True
            except asyncio.CancelledError as exc:
                if not self._end.watch.caused(exc):
                    raise
            finally:
                await self._end.finish(stalled)

    return SseStarletteEventStream


def install(variant: str) -> None:
    """Makes ``gateway.streaming`` stream with ``variant``'s response and batches, in this process."""
    import gateway.streaming as streaming

    if variant == "starlette":
        streaming.EventStreamResponse = StarletteEventStream
        streaming.batches_of = OneByOne  # every event is a plain ``await`` and its own write
    elif variant == "starlette-batches":
        streaming.EventStreamResponse = StarletteEventStream
    elif variant == "sse-starlette":
        streaming.EventStreamResponse = sse_starlette_response()
        streaming.batches_of = OneByOne
    else:
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} VARIANT serve --config FILE --port N (VARIANT: {', '.join(VARIANTS)})")
    install(sys.argv[1])
    from gateway.cli import main as gateway_main

    sys.argv = [sys.argv[0], *sys.argv[2:]]
    gateway_main()


if __name__ == "__main__":
    main()

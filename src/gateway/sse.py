"""Server-sent events written straight to the ASGI server, and the watch for a client that goes away.

What it does. :class:`EventStreamResponse` sends ``http.response.start``, then each frame its ``content`` iterator
yields (the caller, ``gateway.streaming``, yields one frame per burst of ready events), then the empty last message.
A frame goes straight to the connection when it can take it at once (``write_now``: the server's ``DirectBody``,
``gateway.connections``), past the ASGI middleware's send wrappers, which only ever look at the start (issue 23:
each was a coroutine per frame); otherwise, and under servers without one, it is an ``http.response.body`` message
through ASGI's ``send``, which waits for a full socket. The stream's producer may also write frames itself with
``write_now`` between the frames it yields (``gateway.frame_pusher``). The frames are pulled and sent by one task of
their own, which the request's task awaits: each frame's wake-up then resumes that task's few coroutine frames
instead of the whole ASGI middleware stack above this response (issue 23: about a third fewer Python calls per
frame). A stream needs no task group, no lock and no timer per frame. Beside the frames task,
:class:`DisconnectWatch` waits for ``http.disconnect`` and cancels the request's task when it comes; a cancelled
task cancels the task it awaits, so the cancellation reaches the frames wherever they wait (the first token, a
backend's next event, a send to a client that stopped reading). Keep-alive pings are one timer per stream that looks
at the time of the last write when it fires. A send is given the stall timeout only when it could not complete at
once (the ASGI server blocks a send only while the client's socket buffer is full).

The asyncio contract behind that last point (:func:`send_within`). ``send(message)`` is a coroutine; instead of
``await``-ing it, it is stepped once by hand with ``.send(None)``. ``StopIteration`` means it finished without
waiting: the usual case, which costs no timer. Otherwise the step stopped at an ``await`` on some future and
handed that future out (``pending``); this is the object the coroutine would have yielded to the Task had it been
awaited. ``resume(step, pending)`` (``gateway.bursts``) "re-yields the future to the Task": its ``__await__``
yields ``pending`` unchanged, so the Task parks on it exactly as on a plain ``await`` (it adds its wake-up callback
to the future), then passes the value or the exception it is woken with (a cancellation included) back into the
stepped coroutine with ``send`` / ``throw``, until that coroutine returns. It is safe because a Task only ever
sees what coroutines yield, and an ``await`` chain is nothing but each frame yielding its inner frame's future
upwards: one more frame doing the same by hand is indistinguishable. The rules it relies on: the first step runs
inside the same Task that later awaits the rest (the frames task, whose context variables are copied from the
request's and whose cancellation comes from the request's), a started step is always either finished or thrown
into (never dropped), and the future is yielded as it came (never wrapped, never awaited by another task).

Why not Starlette's ``StreamingResponse`` or sse-starlette. Under uvicorn (ASGI spec 2.3) ``StreamingResponse``
runs every stream in an anyio task group with a second task listening for the disconnect, and pings and a stall
timeout need a timer task and an ``asyncio.timeout`` per send beside it; sse-starlette's ``EventSourceResponse``
uses four tasks per stream, a task group and a lock plus a cancel scope per write. Both were measured in place of
this module (and of ``gateway.bursts``) with ``bench/gateway_overhead.py --stream-variants`` (issue 25: fake
upstream, 64-chunk streams, every variant pinned to the same core, interleaved; the table is in the README, "Why
not sse-starlette"): gateway CPU per streamed request was a median 1.17x ours with ``StreamingResponse`` plus a
ping timer (0.95x-1.39x over eight cells: concurrency 1 and 64, chunks at once or 1 ms apart, two runs each) and
1.11x-1.72x with sse-starlette; at concurrency 64, chunks 1 ms apart, the time to first token the gateway adds was
1.35x-1.53x (``StreamingResponse``) and 3.6x-4.5x (sse-starlette) ours. Earlier, against a whole (non-streamed)
response on the same upstream, sse-starlette added about 0.8 ms of CPU per stream and this writer 0.1-0.3 ms
(issue 15).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, cast

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.bursts import resume
from gateway.connections import DIRECT_BODY

PING_FRAME = b": ping\n\n"
"""A comment line: clients ignore it, proxies see traffic on an idle stream."""


class SendStalledError(Exception):
    """One write to the client could not complete within the stall timeout: the client stopped reading."""


class DisconnectWatch:
    """Cancels the current task when the client disconnects, until :meth:`close`.

    The request's body must have been read: from then on the ASGI server's ``receive`` blocks until the client
    goes away. Code that catches the cancellation asks :meth:`caused` whether it came from here (then the task's
    cancellation is withdrawn and the request counts as a disconnect), or from the server (shutdown)."""

    __slots__ = ("_closed", "_task", "_watcher", "disconnected")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "a DisconnectWatch belongs to a request's task"
        self._task = task
        self._closed = False
        self.disconnected = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._closed:
            self.disconnected = True
            self._task.cancel()

    def caused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cancellation this watch delivered; if so it is withdrawn from the task."""
        if isinstance(exc, asyncio.CancelledError) and self.disconnected and self._task.cancelling():
            self._task.uncancel()
            return True
        return False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._watcher.cancel()


def _as_coroutine(sending: Awaitable[None]) -> Coroutine[Any, Any, None]:
    """ASGI's ``send`` is typed as returning an awaitable; every server's (uvicorn's, Starlette's test client's) is an
    ``async def``, whose coroutine can be stepped by hand."""
    return cast("Coroutine[Any, Any, None]", sending)


async def send_within(send: Send, message: Message, stall: float | None) -> None:
    """``send(message)``; if it has to wait (the client is not reading), at most ``stall`` seconds more."""
    step = _as_coroutine(send(message))
    try:
        pending = step.send(None)
    except StopIteration:
        return  # written at once: the usual case costs no timer
    await finish_send(step, pending, stall)


async def finish_send(step: Coroutine[Any, Any, None], pending: Any, stall: float | None) -> None:
    """The rest of a send that could not complete at once (``step`` yielded ``pending``), within ``stall``."""
    if stall is None:
        await resume(step, pending)
        return
    try:
        async with asyncio.timeout(stall):
            await resume(step, pending)
    except TimeoutError:
        raise SendStalledError from None


class EventStreamResponse(Response):
    """``text/event-stream`` of the byte frames ``content`` yields, each yield one write; ``ping_frame`` (a
    comment line unless the API has an event for it) when the stream was silent for ``ping_seconds``.

    ``on_end(stalled)`` is called once the response is over, whichever way: complete, the client gone, a send
    stalled past ``stall_timeout`` (``stalled``), or the server cancelling the request on shutdown (the
    cancellation then goes on). The frames iterator is always closed before, so its cleanup (aborting the
    backend's work) has run."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        watch: DisconnectWatch,
        on_end: Callable[[bool], None],
        *,
        headers: dict[str, str],
        ping_seconds: float | None,
        stall_timeout: float | None,
        ping_frame: bytes = PING_FRAME,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})  # no body: no length
        self._content = content
        self._watch = watch
        self._on_end = on_end
        self._ping_seconds = ping_seconds
        self._ping_frame = ping_frame
        self._stall_timeout = stall_timeout
        self._last_write = 0.0
        self._direct: Callable[[bytes], bool] | None = None  # the server's DirectBody.write, once started
        self._clock: Callable[[], float] = time.monotonic  # the loop's time from the start on (what pings read)
        self._timer: asyncio.TimerHandle | None = None
        self._pinger: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        stall = self._stall_timeout
        stalled = False
        direct = scope.get("state", {}).get(DIRECT_BODY)
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send_within(send, start, stall)
            self._last_write = loop.time()
            if self._ping_seconds:
                self._timer = loop.call_later(self._ping_seconds, self._ping_due, send)
            # The frames are pulled and written by a task of their own, which the request's task awaits: waking
            # for each frame resumes that task's few frames, not the whole ASGI middleware stack above this one.
            # The watch's cancellation of the request's task reaches it (a cancelled task cancels what it awaits).
            self._direct = direct.write if direct is not None else None
            self._clock = loop.time
            await loop.create_task(self._write_frames(send, stall))
            self._watch.close()  # the end of the response makes ``receive`` report a disconnect
            await send_within(send, {"type": "http.response.body", "body": b"", "more_body": False}, stall)
        except SendStalledError:
            stalled = True
            if direct is not None:  # the response cannot complete: its connection goes, as the client's fault
                direct.abandon()
        except asyncio.CancelledError as exc:
            if not self._watch.caused(exc):
                raise  # the server is stopping
        finally:
            await self._end(stalled)

    @property
    def writes_now(self) -> bool:
        """Whether ``write_now`` can write at all: the server offers a ``DirectBody`` (uvicorn behind the gateway's
        connection guard; not a test client)."""
        return self._direct is not None

    def write_now(self, frame: bytes) -> bool:
        """Writes ``frame`` at once, straight to the connection past the ASGI send chain, if the connection takes
        it now (``gateway.connections.DirectBody``: started, socket not full, client there); else writes nothing
        and returns False: the frame is then ``content``'s to yield, and goes through ASGI's ``send``, which waits
        for a full socket within the stall timeout. The stream's producer may call it from any callback on the
        loop while the response runs, between the frames it yields."""
        direct = self._direct
        if direct is not None and direct(frame):
            self._last_write = self._clock()
            return True
        return False

    async def _write_frames(self, send: Send, stall: float | None) -> None:
        """Every frame of ``content``, each one write: at once (``write_now``) when the connection takes it, else
        through ASGI's ``send`` (``send_within`` inlined: a frame sent at once costs no coroutine of its own)."""
        clock = self._clock
        write_now = self.write_now
        send_step = cast("Callable[[Message], Coroutine[Any, Any, None]]", send)  # see _as_coroutine
        async for frame in self._content:
            if write_now(frame):
                continue
            step = send_step({"type": "http.response.body", "body": frame, "more_body": True})
            try:
                pending = step.send(None)
            except StopIteration:
                pass
            else:
                await finish_send(step, pending, stall)
            self._last_write = clock()
        # Stopped here, in the step that wrote the last frame: the request's task resumes only a loop round later,
        # and a ping the timer started meanwhile would follow the stream's end frames (``data: [DONE]``).
        self._stop_pings()

    def _stop_pings(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._pinger is not None:
            self._pinger.cancel()

    async def _end(self, stalled: bool) -> None:
        self._watch.close()
        self._stop_pings()
        await self._content.aclose()
        self._on_end(stalled)

    def _ping_due(self, send: Send) -> None:
        """Timer: a ping if nothing was written for ``ping_seconds``; then the timer is set for the next one."""
        loop = asyncio.get_running_loop()
        interval = self._ping_seconds
        assert interval
        idle = loop.time() - self._last_write
        if idle >= interval:
            if self._pinger is None or self._pinger.done():
                self._pinger = loop.create_task(self._ping(send))
            idle = 0.0
        self._timer = loop.call_later(interval - idle, self._ping_due, send)

    async def _ping(self, send: Send) -> None:
        """A ping waits as long as the client makes it: a stalled client is caught by the next frame's send."""
        with contextlib.suppress(Exception):  # the connection is gone: the disconnect watch ends the stream
            await send({"type": "http.response.body", "body": self._ping_frame, "more_body": True})
            self._last_write = asyncio.get_running_loop().time()

"""Server-sent events written straight to the ASGI server, and the watch for a client that goes away.

What it does. :class:`EventStreamResponse` sends ``http.response.start``, then each chunk of frames its
``content`` iterator yields (``gateway.streaming`` yields one per batch of ready events), then the empty last
message. A chunk goes straight to the connection when it can take it at once (``write_now``: the server's
``DirectBody``, ``gateway.connections``), past the ASGI middleware's send wrappers, which only ever look at the
start; otherwise, and under servers without one, it is an ``http.response.body`` message through ASGI's ``send``,
which waits while the client's socket buffer is full, at most the stall timeout (a ``backends.deadlines.Deadline``
whose idle limit restarts before each send). The chunks are pulled and sent by one task of their own, which the
request's task awaits: each wake-up then resumes that task's few coroutine frames instead of the whole ASGI
middleware stack above this response. Beside it, :class:`DisconnectWatch` waits for ``http.disconnect`` and
cancels the request's task when it comes; a cancelled task cancels the task it awaits, so the cancellation reaches
the frames wherever they wait (the first token, a backend's next batch, a send to a client that stopped reading).
Keep-alive pings are one timer per stream that looks at the time of the last write when it fires.

Why not Starlette's ``StreamingResponse`` or sse-starlette: they run each stream in a task group with a second
task listening for the disconnect, and pings and a stall timeout need more tasks and a timeout scope per send; the
measurements are in the README ("Why not sse-starlette").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from backends.interface import Deadline, DeadlineExpired, TaskCancel
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

    __slots__ = ("_cancel", "_watcher")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "a DisconnectWatch belongs to a request's task"
        self._cancel = TaskCancel(task)
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(self._watch(receive))
        """None once closed."""

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._watcher is not None:
            self._cancel.cancel()

    def caused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cancellation this watch delivered; if so it is withdrawn from the task."""
        return self._cancel.claim(exc)

    def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            # let go before it ends: its CancelledError's traceback holds ``_watch``'s frame, and through it this
            # watch, so a watch still holding the task would make a reference cycle of the whole request
            watcher.cancel()


class SendLimit:
    """ASGI sends, each allowed to block at most ``stall`` seconds (None: no limit) before ``SendStalledError``."""

    __slots__ = ("_deadline", "_send")

    def __init__(self, send: Send, stall: float | None) -> None:
        self._send = send
        self._deadline = Deadline(None, stall) if stall else None

    async def __call__(self, message: Message) -> None:
        deadline = self._deadline
        if deadline is None:
            await self._send(message)
            return
        deadline.touch()
        try:
            await deadline.bounded(lambda: self._send(message))
        except DeadlineExpired:
            raise SendStalledError from None

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.close()


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
        limited = SendLimit(send, self._stall_timeout)
        stalled = False
        direct = scope.get("state", {}).get(DIRECT_BODY)
        try:
            await limited({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self._last_write = loop.time()
            if self._ping_seconds:
                self._timer = loop.call_later(self._ping_seconds, self._ping_due, send)
            # The frames are pulled and written by a task of their own, which the request's task awaits: waking
            # for each frame resumes that task's few frames, not the whole ASGI middleware stack above this one.
            # The watch's cancellation of the request's task reaches it (a cancelled task cancels what it awaits).
            self._direct = direct.write if direct is not None else None
            self._clock = loop.time
            await loop.create_task(self._write_frames(limited))
            self._watch.close()  # the end of the response makes ``receive`` report a disconnect
            await limited({"type": "http.response.body", "body": b"", "more_body": False})
        except SendStalledError:
            stalled = True
            if direct is not None:  # the response cannot complete: its connection goes, as the client's fault
                direct.abandon()
        except asyncio.CancelledError as exc:
            if not self._watch.caused(exc):
                raise  # the server is stopping
        finally:
            limited.close()
            await self._end(stalled)

    def write_now(self, chunk: bytes) -> bool:
        """Writes ``chunk`` straight to the connection if it takes it now (``DirectBody``: started, socket not
        full, client there), from any callback on the loop while the response runs; False, and nothing written,
        otherwise (and always under a server without ``DirectBody``): the chunk is then ``content``'s to yield."""
        direct = self._direct
        if direct is not None and direct(chunk):
            self._last_write = self._clock()
            return True
        return False

    async def _write_frames(self, limited: SendLimit) -> None:
        """Every chunk of ``content``, each one write: straight to the connection when it takes it now
        (``gateway.connections.DirectBody``: started, socket not full, client there), else through ASGI's
        ``send``, which waits for a full socket within the stall timeout."""
        clock = self._clock
        direct = self._direct
        async for frame in self._content:
            if direct is None or not direct(frame):
                await limited({"type": "http.response.body", "body": frame, "more_body": True})
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

"""A stream's frames written as its backend's outputs arrive, with no task woken per frame.

What it does. A streaming request whose backend offers a synchronous view of its events (``PolledStream``: the
engine backends, in process or on data-parallel ranks) and whose server takes writes straight to the connection
(``EventStreamResponse.write_now``) does not wake its task for each engine step. While the task waits, the
stream's ``FramePusher`` is the backend's listener: called right where the driver puts a step's outputs into the
request's buffer, it polls the events, renders their frames and writes them to the client, all synchronously.
The task is woken only for what needs it (``park`` returns it, as a ``Handover``): the stream's end (the usage,
which settles the budget before the last frames), an error, an event that is not a delta or a finish, and frames
the connection did not take at once (a client that stopped reading: the task sends them through ASGI, which waits
for the socket within the stall timeout).

Why. On the rank path each engine step ends in one frame per stream; waking the stream's task for it (the
future, the task step, the coroutines between the task and the backend, each ``await`` on the way back) cost
more than rendering and writing the frame (issue 23).

What stays as it was: the request's deadline (its timer cancels the task, which waits in ``park``; each frame
pushed restarts the idle part of it), the client leaving (the disconnect watch cancels the task; ``stop`` then
detaches the listener before the backend's stream is closed), pings (``write_now`` counts as a write).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from backends.interface import Delta, Event, EventPoller, Finish, PromptEcho


class Handover(NamedTuple):
    """What the listener left for the task: frames the connection did not take (or None), then an event to
    render (``Usage`` or a rare kind) or the exception ``poll`` raised (the stream's end or error), or neither."""

    frames: bytes | None
    event: Event | None
    error: BaseException | None


class FramePusher:
    """Renders and writes a stream's frames from its backend's listener while the stream's task waits."""

    __slots__ = ("_frame_of", "_mark", "_output", "_poller", "_wake", "_write")

    def __init__(
        self,
        poller: EventPoller[Event],
        frame_of: Callable[[Delta | Finish | PromptEcho], bytes | None],
        output: Callable[[int, int], None],
        write_now: Callable[[bytes], bool],
        mark: Callable[[], None] | None,
    ) -> None:
        self._poller = poller
        self._frame_of = frame_of
        self._output = output  # counts a delta's tokens (the request's observer)
        self._write = write_now
        self._mark = mark  # an event came: the deadline's idle part starts again
        self._wake: asyncio.Future[Handover] | None = None

    def park(self) -> bool:
        """Becomes the backend's listener, when ``poll`` just returned None; ``parked()`` is then the future done
        with what the task must take over. False when the stream refuses a listener now (it waits for something
        else: the task then awaits its ``arrival``)."""
        self._wake = asyncio.get_running_loop().create_future()
        if not self._poller.listen(self._pushed):
            self._wake = None
            return False
        return True

    def parked(self) -> asyncio.Future[Handover]:
        """What the task awaits after ``park()``."""
        assert self._wake is not None, "parked() without park()"
        return self._wake

    def stop(self) -> None:
        """Detaches the listener (the task was cancelled while parked, or the stream is over)."""
        if self._wake is not None:
            self._wake = None
            self._poller.listen(None)

    def _pushed(self) -> None:
        """The listener: every ready event's frame, written in one go; never raises (it runs in the driver)."""
        wake = self._wake
        if wake is None or wake.done():
            return  # the task was cancelled (client gone, deadline) and has not run yet: it ends the stream
        frames: list[bytes] = []
        handed: Event | None = None
        error: BaseException | None = None
        poll, frame_of = self._poller.poll, self._frame_of
        try:
            while True:
                event = poll()
                if event is None:
                    break
                if type(event) is Delta:
                    self._output(event.tokens, event.prompt_tokens)
                    frame = frame_of(event)
                elif type(event) is Finish:
                    frame = frame_of(event)
                else:  # the usage (the stream's end), a prompt echo: the task's
                    handed = event
                    break
                if frame is not None:
                    frames.append(frame)
        except BaseException as exc:  # StopAsyncIteration or the stream's error: the task ends the stream
            error = exc
        data = (frames[0] if len(frames) == 1 else b"".join(frames)) if frames else None
        if data is not None:
            if self._mark is not None:
                self._mark()
            if self._write(data):
                data = None
        if data is None and handed is None and error is None:
            return  # all written: the task sleeps on
        self._wake = None
        self._poller.listen(None)
        wake.set_result(Handover(data, handed, error))

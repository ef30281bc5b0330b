"""Running a backend's event stream for one HTTP request: SSE or a whole response, and client disconnects.

A streamed request's body is one loop (:meth:`_StreamBody.frames`): take the batch of events the backend has
ready (``backends.streams.BatchStream``), render it into one chunk of frames, hand it to the response to write,
then wait for more. Events that arrived together (one engine step, one network read, outputs queued while the
loop was busy) therefore cost one write. The response (``gateway.sse``) writes each chunk straight to the socket
when it takes it, else through ASGI's ``send``.

When the connection takes direct writes, the task does not wake for every engine step: :class:`_Pusher` takes
the batches as they come, renders and writes them, and wakes the task only for what needs it (the stream's end,
an error, a chunk the socket did not take). The engine backends' streams call it straight from their driver's
delivery of a step (``backends.streams.Notifying``); any other stream whose wait is a future calls it from that
future's callback. Waking the task for every engine step cost more than rendering and writing the step's frame,
and a future plus a loop callback per stream per step cost a few percent more on rank workers; the measurements
are in docs/bench.md ("One batch contract", "The writer woken by the driver").

Starlette does not cancel a handler when its client goes away, so every wait that can be long (the first token,
the next batch, a whole non-streamed completion) races against the ``http.disconnect`` message
(``gateway.sse.DisconnectWatch``). When the client wins, the event stream is closed, which aborts the engine
request. Waits for the backend are bounded by the request's ``backends.deadlines.Deadline``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from typing import Any, NamedTuple, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from backends.errors import BackendError, SlowClientError
from backends.interface import (
    BatchStream,
    Deadline,
    Delta,
    Event,
    EventStream,
    Finish,
    PromptEcho,
    Usage,
    batches_of,
    interleave,
    notify_of,
)
from gateway.deadlines import Timeouts, deadline_of
from gateway.errors import APIError, api_error_from_backend, internal_error, public_error
from gateway.metrics import RequestObserver
from gateway.sse import DisconnectWatch, EventStreamResponse

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away
SLOW_CLIENT_STATUS = 408  # logged for a stream stopped because its client did not read


STREAM_END = StopAsyncIteration()
"""How the pusher tells the task that the stream ended; never raised. Keeping the caught ``StopAsyncIteration``
instead would hold the pusher's frame through its traceback, and with it the whole request in a reference cycle
that only the cycle collector frees: every request's objects would pass through it."""

Completion = Callable[[Usage | None], Awaitable[None]]
"""Awaited with the usage once a response is complete, before its last event or its body goes out: the key's
budget is settled and the Responses API stores the response here, so the client's next request sees both."""


class WireFormat(Protocol):
    """How one API writes a request's events: chat, completions, the Responses API, Anthropic's Messages."""

    done_frame: bytes | None  # what follows an error frame (chat and completions: [DONE])
    ping_frame: bytes  # what a stream silent for ``ping_seconds`` gets, so proxies keep it open

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None: ...
    def end_frames(self, usage: Usage | None, include_usage: bool) -> bytes:
        """The last frames of a stream that ended well (the usage when asked for, and what ends the stream)."""
        ...

    def error_frame(self, error: APIError) -> bytes: ...
    def add(self, event: Delta | Finish | PromptEcho) -> None: ...
    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]: ...


class Serving(NamedTuple):
    """How a response presents itself: its wire format and headers, which name the backend that serves it. Built
    once the first event is in, when no fallback can take the request over any more."""

    wire: WireFormat
    headers: dict[str, str]


async def _first_events(events: AsyncIterator[Event], deadline: Deadline | None) -> list[Event]:
    """Pulls events up to and including the first that carries output, so the first frame is real."""
    head: list[Event] = []
    while True:
        try:
            if deadline is None:
                event = await anext(events)
            else:
                event = await deadline.bounded(events.__anext__)
        except StopAsyncIteration:
            return head
        head.append(event)
        if not isinstance(event, PromptEcho):
            return head


class _Pusher:
    """Writes a stream's batches while the stream's task sleeps (see the module): called by the producer itself
    when the batches offer it (``Notifying``), else from the callbacks of the futures their ``wait`` returns."""

    __slots__ = ("_batches", "_notify", "_render", "_touch", "_wake", "_write")

    def __init__(
        self,
        batches: BatchStream[Event],
        render: Callable[[list[Event]], bytes],
        write_now: Callable[[bytes], bool],
        touch: Callable[[], None] | None,
    ) -> None:
        self._batches = batches
        self._notify = notify_of(batches)
        self._render = render
        self._write = write_now
        self._touch = touch  # an output came: the deadline's idle limit starts again
        self._wake: asyncio.Future[tuple[bytes | None, BaseException | None]] | None = None

    def park(self) -> asyncio.Future[tuple[bytes | None, BaseException | None]] | None:
        """What the task awaits instead of the batches' wait: done with a chunk the socket did not take (or None)
        and the error or ``StopAsyncIteration`` that ended the stream (or None). None when the batches can neither
        notify nor give a future to wait on: the task then waits itself."""
        wake = self._wake = asyncio.get_running_loop().create_future()
        if self._armed():
            return wake
        self._wake = None
        return None

    def stop(self) -> None:
        """The task stopped waiting (cancelled, or woken): later callbacks do nothing."""
        self._wake = None

    def _armed(self) -> bool:
        """Whether the next batch will call ``_pushed``: the producer's ``notify``, else the callback of the
        future the batches' wait returns; False when neither can (the task then waits for the batches itself)."""
        if self._notify(self._pushed):
            return True
        more = self._batches.wait()
        if isinstance(more, asyncio.Future):
            more.add_done_callback(self._more)
            return True
        if isinstance(more, Coroutine):
            more.close()
        return False

    def _more(self, _: object) -> None:
        """The wait's callback."""
        self._pushed()

    def _pushed(self) -> None:
        """``ready()`` may have more: every ready batch rendered and written, then the next wait; never raises."""
        wake = self._wake
        if wake is None or wake.done():
            return  # the task was cancelled (client gone, deadline) and ends the stream itself
        chunks: list[bytes] = []
        ended: BaseException | None = None
        try:
            while batch := self._batches.ready():
                chunks.append(self._render(batch))
        except StopAsyncIteration:  # the stream's end, after the batches before it
            ended = STREAM_END
        except BaseException as exc:  # the stream's error, after the batches before it
            ended = exc
        unsent: bytes | None = (chunks[0] if len(chunks) == 1 else b"".join(chunks)) or None
        if unsent is not None and ended is None:  # the last frames go out with the end frames, in one write
            if self._touch is not None:
                self._touch()
            if self._write(unsent):
                unsent = None
        if unsent is None and ended is None and self._armed():
            return  # all written: the task sleeps on
        self._wake = None
        wake.set_result((unsent, ended))


class _StreamBody:
    """The frames of one streamed request, and how its stream ended (``status`` None: it was interrupted)."""

    __slots__ = (
        "_deadline",
        "_events",
        "_include_usage",
        "_observer",
        "_on_complete",
        "_request",
        "_wire",
        "code",
        "status",
        "usage",
        "write_now",
    )

    def __init__(
        self,
        request: Request,
        events: EventStream[Event],
        wire: WireFormat,
        observer: RequestObserver,
        deadline: Deadline | None,
        include_usage: bool,
        on_complete: Completion | None,
    ) -> None:
        self._request = request
        self._events = events
        self._wire = wire
        self._observer = observer
        self._deadline = deadline
        self._include_usage = include_usage
        self._on_complete = on_complete
        self.status: int | None = None
        self.code: str | None = None
        self.usage: Usage | None = None
        self.write_now: Callable[[bytes], bool] | None = None
        """The response's direct write (``EventStreamResponse.write_now``), set before the body runs, which takes it."""

    async def frames(self, head: list[Event]) -> AsyncGenerator[bytes, None]:
        """The response body, written by one loop: the first token's frame at once, then each batch of events the
        backend has ready as one chunk, then a wait for more; at last the stream's end, or an error frame (after
        the first frame a failure can no longer be an HTTP status). The last batch's frames go out with the end
        frames, in one write."""
        batches = batches_of(self._events)
        deadline = self._deadline
        pusher = None
        # Held by this generator's frame from here, which goes when the body ends: the response holds this body,
        # and an attribute holding the response's method would make the two a reference cycle.
        write_now, self.write_now = self.write_now, None
        if write_now is not None:
            pusher = _Pusher(batches, self._render, write_now, deadline.touch if deadline is not None else None)
        tail: list[bytes] = []
        try:
            batch = head
            while True:
                if batch:
                    chunk: bytes | None = self._render(batch)
                else:
                    chunk, ended = await self._wait(batches, pusher)
                    if ended is not None:
                        if chunk:
                            tail.append(chunk)  # before the end frames or the error frame, in one write
                        if isinstance(ended, StopAsyncIteration):
                            break
                        raise ended
                try:
                    batch = batches.ready()  # what came meanwhile, or the stream's end: then ``chunk`` is its last
                except StopAsyncIteration:
                    if chunk:
                        tail.append(chunk)
                    break
                except BaseException:
                    if chunk:
                        tail.append(chunk)
                    raise
                if chunk:
                    yield chunk
            self.status = 200
        except BackendError as exc:
            tail.append(self._failed(api_error_from_backend(exc)))
        except Exception as exc:
            logger.exception("stream of request %s failed after its first frame", self._request.state.request_id)
            self.code = "internal_error"
            tail.append(self._failed(internal_error(exc)))
        finally:
            if pusher is not None:
                pusher.stop()
            if deadline is not None:
                deadline.close()
            await self._events.aclose()  # a cancelled stream (client gone) still aborts its backend's work
        if self.status == 200:
            tail.append(self._wire.end_frames(self.usage, self._include_usage))
            if self._on_complete is not None:
                await self._on_complete(self.usage)
        elif self.status is not None and self._wire.done_frame is not None:
            tail.append(self._wire.done_frame)
        if self.status is not None:
            yield b"".join(tail)

    async def _wait(
        self, batches: BatchStream[Event], pusher: _Pusher | None
    ) -> tuple[bytes | None, BaseException | None]:
        """Waits for the backend's next batch, within the deadline; with a pusher, while it writes the batches
        that come, until it hands the stream back (a chunk it could not write, the stream's end or error)."""
        deadline = self._deadline
        wake = pusher.park() if pusher is not None else None
        if pusher is not None and wake is not None:
            try:
                return await (wake if deadline is None else deadline.bounded(lambda: wake))
            finally:
                pusher.stop()
        more = batches.wait()
        await (more if deadline is None else deadline.bounded(lambda: more))
        return None, None

    def _render(self, batch: list[Event]) -> bytes:
        """The frames of a batch of events, joined; a ``Usage`` (the last event) is kept for the stream's end."""
        frames: list[bytes] = []
        output, frame_of = self._observer.output, self._wire.frame
        for event in batch:
            kind = type(event)
            if kind is Delta:
                output(event.tokens, event.prompt_tokens)  # type: ignore[union-attr]
            elif kind is Usage:
                self.usage = event  # type: ignore[assignment]
                continue
            frame = frame_of(event)  # type: ignore[arg-type]
            if frame is not None:
                frames.append(frame)
        return frames[0] if len(frames) == 1 else b"".join(frames)

    def _failed(self, error: APIError) -> bytes:
        self.status = error.status
        if self.code is None:
            self.code = error.code or error.type
        return self._wire.error_frame(public_error(error, self._request))

    def record(self, stalled: bool) -> None:
        """Counts the stream once it is over, whichever way it ended (``EventStreamResponse``'s ``on_end``)."""
        observer, usage = self._observer, self.usage
        if stalled:
            observer.stalled("send_timeout")
            observer.finish(SLOW_CLIENT_STATUS, usage, "stream_stalled")
        elif self.status is None:  # the client went away (or the server is stopping and cancelled the stream)
            observer.finish(CLIENT_CLOSED_REQUEST, usage, "client_disconnected")
        else:
            if self.code == SlowClientError.code:
                observer.stalled("buffer_full")
            observer.finish(self.status, usage, self.code)


async def stream_response(
    request: Request,
    events: EventStream[Event],
    serving: Callable[[], Serving],
    observer: RequestObserver,
    *,
    include_usage: bool,
    timeouts: Timeouts | None = None,
    ping_seconds: float | None = 15.0,
    on_complete: Completion | None = None,
) -> Response:
    """SSE response. Errors before the first token are plain HTTP errors; any later failure is an error frame
    followed by ``[DONE]``. A client that leaves cancels the request's task wherever it waits (``DisconnectWatch``),
    and the event iterator is closed, which aborts the backend's work."""
    deadline = deadline_of(timeouts)
    watch = DisconnectWatch(request.receive)
    try:
        head = await _first_events(events, deadline)
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: the request just ends here
        raise
    wire, headers = serving()
    body = _StreamBody(request, events, wire, observer, deadline, include_usage, on_complete)
    response = EventStreamResponse(
        body.frames(head),
        watch,
        body.record,
        headers=headers,
        ping_seconds=ping_seconds,
        ping_frame=wire.ping_frame,
        stall_timeout=timeouts.stall if timeouts else None,
    )
    body.write_now = response.write_now
    return response


async def whole_response(
    request: Request,
    events: EventStream[Event],
    serving: Callable[[], Serving],
    observer: RequestObserver,
    *,
    want_logprobs: bool,
    timeouts: Timeouts | None = None,
    on_complete: Completion | None = None,
) -> Response:
    """A whole JSON response, its events collected within the request's deadline."""
    deadline = deadline_of(timeouts)

    served: Serving | None = None  # once the first event is in

    async def collect() -> Usage | None:
        nonlocal served
        usage = None
        wire: WireFormat | None = None
        async for event in events:
            if deadline is not None:
                deadline.touch()
            if isinstance(event, Usage):
                usage = event
            else:
                if isinstance(event, Delta):
                    observer.output(event.tokens, event.prompt_tokens)
                if wire is None:
                    served = serving()
                    wire = served.wire
                wire.add(event)
        return usage

    watch = DisconnectWatch(request.receive)
    try:
        usage = await (collect() if deadline is None else deadline.bounded(collect))
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    finally:
        if deadline is not None:
            deadline.close()
    watch.close()
    await events.aclose()
    if served is None:  # no output at all
        served = serving()
    body = orjson.dumps(served.wire.response(usage, want_logprobs))
    if on_complete is not None:
        await on_complete(usage)
    observer.finish(200, usage)
    return Response(body, media_type="application/json", headers=served.headers)


async def _ended_early(
    watch: DisconnectWatch, events: EventStream[Event], observer: RequestObserver, exc: BaseException
) -> bool:
    """Ends a request whose wait for the backend raised ``exc``: the backend's work is aborted and the request
    counted. True when ``exc`` was the client leaving (its cancellation is withdrawn), else the caller re-raises."""
    watch.close()
    gone = watch.caused(exc)
    await events.aclose()
    _observe_failure(observer, exc)
    return gone


def _observe_failure(observer: RequestObserver, exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError):  # the client left, or the server is stopping
        observer.finish(CLIENT_CLOSED_REQUEST, code="client_disconnected")
    elif isinstance(exc, BackendError):
        if isinstance(exc, SlowClientError):
            observer.stalled("buffer_full")
        error = api_error_from_backend(exc)
        observer.finish(error.status, code=error.code or error.type)
    else:
        observer.finish(500, code="internal_error")


async def merge_prompts(streams: list[EventStream[Event]], n: int) -> AsyncGenerator[Event, None]:
    """Runs one event stream per prompt concurrently, renumbering choices ``prompt_index * n + i`` and
    adding the usages up, as OpenAI does for a list of prompts."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    async with aclosing(interleave(streams)) as merged:
        async for index, event in merged:
            if isinstance(event, Usage):
                prompt_tokens += event.prompt_tokens
                completion_tokens += event.completion_tokens
                cached_tokens += event.cached_tokens
            else:
                yield event._replace(index=index * n + event.index)
    yield Usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens)

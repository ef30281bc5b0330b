"""Running a backend's event stream for one HTTP request: SSE or a whole response, and client disconnects.

Starlette does not cancel a handler when its client goes away, so every wait that can be long (the first
token, a whole non-streamed completion) races against the ``http.disconnect`` message. When the client
wins, the event iterator is closed, which aborts the engine request.

A stream's frames after the first are pulled in bursts (``gateway.bursts``), or, from a backend whose stream has a
synchronous view (``backends.streams.PolledStream``), polled: one call per event. While such a stream waits, its
frames are written as the backend's outputs arrive, with no task woken per frame (``gateway.frame_pusher``).
Deadlines are ``gateway.deadlines``'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NamedTuple, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from backends.errors import BackendError, SlowClientError
from backends.interface import Delta, Event, EventPoller, EventStream, Finish, PromptEcho, Usage, interleave, poller_of
from gateway.bursts import BurstReader
from gateway.deadlines import Deadline, Expiry, Timeouts, WaitDeadline, next_event
from gateway.errors import APIError, api_error_from_backend, internal_error, public_error
from gateway.frame_pusher import FramePusher
from gateway.metrics import RequestObserver
from gateway.sse import DisconnectWatch, EventStreamResponse

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away
SLOW_CLIENT_STATUS = 408  # logged for a stream stopped because its client did not read
MAX_BURST = 64
"""Frames written to a client in one send at most, when that many were ready at once."""


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

    fmt: WireFormat
    headers: dict[str, str]


async def _first_token_events(events: AsyncIterator[Event], deadline: Deadline | None) -> list[Event]:
    """Pulls events up to and including the first that carries output, so the first frame is real."""
    head: list[Event] = []
    while True:
        try:
            event = await next_event(events, deadline)
        except StopAsyncIteration:
            return head
        head.append(event)
        if not isinstance(event, PromptEcho):
            return head


class _Outcome:
    """How a stream ended, as far as its frames generator knows; ``None`` status: it was interrupted."""

    __slots__ = ("code", "status", "usage")

    def __init__(self) -> None:
        self.status: int | None = None
        self.code: str | None = None
        self.usage: Usage | None = None


def _record(observer: RequestObserver, outcome: _Outcome, stalled: bool) -> None:
    """Counts a stream once it is over, whichever way it ended."""
    usage = outcome.usage
    if stalled:
        observer.stalled("send_timeout")
        observer.finish(SLOW_CLIENT_STATUS, usage, "stream_stalled")
    elif outcome.status is None:  # the client went away (or the server is stopping and cancelled the stream)
        observer.finish(CLIENT_CLOSED_REQUEST, usage, "client_disconnected")
    else:
        if outcome.code == SlowClientError.code:
            observer.stalled("buffer_full")
        observer.finish(outcome.status, usage, outcome.code)


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
    deadline = Deadline(timeouts) if timeouts else None
    watch = DisconnectWatch(request.receive)
    try:
        head = await _first_token_events(events, deadline)
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: the request just ends here
        raise
    fmt, headers = serving()
    outcome = _Outcome()

    async def frames() -> AsyncGenerator[bytes, None]:
        """The response body: every frame the backend had ready goes out in one send (a burst), so events that
        arrived together (one network read, a step's outputs queued while the loop was busy) cost one write."""

        def render(event: Event) -> bytes | None:
            if isinstance(event, Usage):  # the last event: its frame goes out with the stream's end
                outcome.usage = event
                return None
            if isinstance(event, Delta):
                observer.output(event.tokens, event.prompt_tokens)
            return fmt.frame(event)

        reader = BurstReader(events)
        waits = WaitDeadline(deadline) if deadline is not None else None
        output, frame_of = observer.output, fmt.frame
        burst: list[bytes] = []
        event: Event | None
        pusher: FramePusher | None = None
        try:
            for event in head:  # the first token goes out at once
                frame = render(event)
                if frame is not None:
                    burst.append(frame)
            if burst:
                yield b"".join(burst)
                burst.clear()
            # From here on, a stream that has a synchronous view (the engine backends') is polled: one call per
            # event, where an await goes through every wrapper's coroutine.
            poller: EventPoller[Event] | None = poller_of(events)
            if poller is not None:
                poll, arrival = poller.poll, poller.arrival
                if response.writes_now:  # and while it waits, the frames are written as the outputs come
                    touch = deadline.touch if deadline is not None else None
                    pusher = FramePusher(poller, frame_of, output, response.write_now, touch)
            while True:
                try:
                    if poller is not None:
                        event = poll()
                        if event is None:  # the backend has nothing more for now: send what it had, then wait
                            if burst:
                                yield burst[0] if len(burst) == 1 else b"".join(burst)
                                burst.clear()
                                continue  # more may have come while it was sent
                            if pusher is None or not pusher.park():
                                await (arrival() if waits is None else waits.wait(arrival))
                                continue
                            parked = pusher.parked
                            unsent, handed, raised = await (parked() if waits is None else waits.wait(parked))
                            if unsent is not None:  # the connection did not take them at once: sent through ASGI
                                burst.append(unsent)
                            if raised is not None:  # the stream's end or its error, as ``poll`` raised it
                                raise raised
                            if handed is None:
                                continue
                            event = handed
                    else:
                        event = reader.ready()
                        if event is None:  # the same, for a stream without a synchronous view
                            if burst:
                                yield burst[0] if len(burst) == 1 else b"".join(burst)
                                burst.clear()
                            event = await (reader.wait() if waits is None else waits.wait(reader.wait))
                except StopAsyncIteration:
                    outcome.status = 200
                    break
                if type(event) is Delta:  # the common event, rendered here: no call of ``render`` per frame
                    output(event.tokens, event.prompt_tokens)
                    frame = frame_of(event)
                else:
                    frame = render(event)
                if frame is not None:
                    burst.append(frame)
                    if len(burst) >= MAX_BURST:
                        yield b"".join(burst)
                        burst.clear()
        except BackendError as exc:
            error = api_error_from_backend(exc)
            outcome.status, outcome.code = error.status, error.code or error.type
            burst.append(fmt.error_frame(public_error(error, request)))
        except Exception as exc:
            logger.exception("stream of request %s failed after its first frame", request.state.request_id)
            outcome.status, outcome.code = 500, "internal_error"
            error = internal_error(exc)
            burst.append(fmt.error_frame(public_error(error, request)))
        finally:
            if pusher is not None:
                pusher.stop()
            if waits is not None:
                waits.close()
            # A cancelled stream still aborts its backend work: the cancellation was spent at the pending await.
            await reader.aclose()
        if outcome.status == 200:
            burst.append(fmt.end_frames(outcome.usage, include_usage))
            if on_complete is not None:
                await on_complete(outcome.usage)
        elif outcome.status is not None and fmt.done_frame is not None:
            burst.append(fmt.done_frame)
        if outcome.status is not None and burst:
            yield b"".join(burst)

    response = EventStreamResponse(
        frames(),
        watch,
        lambda stalled: _record(observer, outcome, stalled),
        headers=headers,
        ping_seconds=ping_seconds,
        ping_frame=fmt.ping_frame,
        stall_timeout=timeouts.stall if timeouts else None,
    )
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
    deadline = Deadline(timeouts) if timeouts else None

    served: Serving | None = None  # once the first event is in

    async def collect() -> Usage | None:
        nonlocal served
        usage = None
        fmt: WireFormat | None = None
        async for event in events:
            if deadline is not None:
                deadline.last = deadline.loop.time()  # the idle part of the deadline restarts at each event
            if isinstance(event, Usage):
                usage = event
            else:
                if isinstance(event, Delta):
                    observer.output(event.tokens, event.prompt_tokens)
                if fmt is None:
                    served = serving()
                    fmt = served.fmt
                fmt.add(event)
        return usage

    async def collectwithin() -> Usage | None:
        if deadline is None:
            return await collect()
        async with Expiry(deadline):
            return await collect()

    watch = DisconnectWatch(request.receive)
    try:
        usage = await collectwithin()
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    watch.close()
    await events.aclose()
    if served is None:  # no output at all
        served = serving()
    body = orjson.dumps(served.fmt.response(usage, want_logprobs))
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

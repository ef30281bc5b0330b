"""Running a backend's event stream for one HTTP request: SSE or a whole response, and client disconnects.

Starlette does not cancel a handler when its client goes away, so every wait that can be long (the first
token, a whole non-streamed completion) races against the ``http.disconnect`` message. When the client
wins, the event iterator is closed, which aborts the engine request.
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

from backends.errors import BackendError, BackendTimeoutError, SlowClientError
from backends.interface import Delta, Event, EventStream, Finish, PromptEcho, Usage, interleave
from gateway.bursts import BurstReader
from gateway.errors import APIError, api_error_from_backend, public_error
from gateway.metrics import RequestObserver
from gateway.sse import DisconnectWatch, EventStreamResponse

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away
SLOW_CLIENT_STATUS = 408  # logged for a stream stopped because its client did not read
MAX_BURST = 64
"""Frames written to a client in one send at most, when that many were ready at once."""


class Timeouts(NamedTuple):
    total: float | None  # seconds from arrival to the last token
    idle: float | None  # seconds between two events (the first token included)
    stall: float | None = None  # seconds one send to a streaming client may block before the stream is stopped


class _Deadline:
    """A request's deadline: its total deadline, or ``idle`` after the last event, whichever comes first."""

    __slots__ = ("_end", "_idle", "_timeouts", "last", "loop")

    def __init__(self, timeouts: Timeouts) -> None:
        self.loop = asyncio.get_running_loop()
        self._timeouts = timeouts
        now = self.loop.time()
        self._end = now + timeouts.total if timeouts.total else None
        self._idle = timeouts.idle
        self.last = now

    def next(self) -> float | None:
        idle_end = self.last + self._idle if self._idle else None
        if self._end is None:
            return idle_end
        return self._end if idle_end is None else min(self._end, idle_end)

    def expired(self) -> BackendTimeoutError:
        if self._end is not None and self.loop.time() >= self._end:
            return BackendTimeoutError(f"The request took longer than its {self._timeouts.total:g} s deadline.")
        return BackendTimeoutError(f"No output from the backend for {self._timeouts.idle:g} s.")


class _Expiry:
    """The request's deadline over many waits at once (a whole response): one timer, re-armed lazily. An event
    only moves ``deadline.last``; when the timer fires it checks whether the deadline really passed, and re-arms at
    the later one if not. Expiry goes through an ``asyncio.Timeout`` (cancel the task, then ``TimeoutError``),
    so its bookkeeping of cancellations is asyncio's own, and is raised as the deadline's ``BackendTimeoutError``.
    """

    __slots__ = ("_deadline", "_handle", "_scope")

    def __init__(self, deadline: _Deadline) -> None:
        self._deadline = deadline
        self._scope = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        await self._scope.__aenter__()
        at = self._deadline.next()
        if at is not None:
            self._handle = self._deadline.loop.call_at(at, self._check)

    def _check(self) -> None:
        at = self._deadline.next()
        now = self._deadline.loop.time()
        if at is not None and at > now:
            self._handle = self._deadline.loop.call_at(at, self._check)
        else:
            self._handle = None
            self._scope.reschedule(now)  # expires the scope now: it cancels the task

    async def __aexit__(self, kind: Any, exc: Any, traceback: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        try:
            await self._scope.__aexit__(kind, exc, traceback)
        except TimeoutError:
            raise self._deadline.expired() from None


class _WaitDeadline:
    """The request's deadline over a stream's waits for the backend, frame after frame: one timer for the whole
    stream, re-armed lazily (a wait only records its end), that cancels the task only while it waits for the
    backend, never during a send to the client (that is the stall timeout's). A timer firing during a wait finds
    the task suspended in it, so the cancellation lands there; an ``asyncio.timeout`` per wait cost a timer, a
    cancellation and a scope per frame."""

    __slots__ = ("_cancelling", "_deadline", "_expired", "_handle", "_task", "_waiting")

    def __init__(self, deadline: _Deadline) -> None:
        self._deadline = deadline
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._waiting = False
        self._expired = False
        self._cancelling = 0

    def _arm(self) -> None:
        at = self._deadline.next()
        self._handle = None if at is None else self._deadline.loop.call_at(at, self._check)

    def _check(self) -> None:
        self._handle = None
        if not self._waiting:
            return  # the next wait arms it again
        at = self._deadline.next()
        if at is not None and at > self._deadline.loop.time():
            self._arm()
            return
        self._expired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    async def wait(self, wait: Callable[[], Awaitable[Event]]) -> Event:
        """``wait()``, bounded by the deadline (``BackendTimeoutError``, as ``_within``)."""
        deadline = self._deadline
        at = deadline.next()
        if at is not None and at <= deadline.loop.time():
            raise deadline.expired()  # it passed while the frames before were being sent
        if self._handle is None and at is not None:
            self._handle = deadline.loop.call_at(at, self._check)
        self._waiting = True
        try:
            event = await wait()
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if self._task.uncancel() <= self._cancelling:
                    raise deadline.expired() from None
            raise
        finally:
            self._waiting = False
        deadline.last = deadline.loop.time()
        return event

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _next_event(events: AsyncIterator[Event], deadline: _Deadline | None) -> Event:
    """The next event, or ``BackendTimeoutError`` once the deadline passes (the backend's work is aborted,
    since the timeout cancels the iterator's pending await and its cleanup runs). The timeout only ever spans
    the wait for the backend, never a send to the client."""
    return await _within(deadline, lambda: anext(events))


async def _within(deadline: _Deadline | None, wait: Callable[[], Awaitable[Event]]) -> Event:
    """``wait()``, bounded by the request's deadline (see ``_next_event``)."""
    if deadline is None:
        return await wait()
    at = deadline.next()
    if at is None:
        event = await wait()
    else:
        try:
            async with asyncio.timeout_at(at):
                event = await wait()
        except TimeoutError:
            raise deadline.expired() from None
    deadline.last = deadline.loop.time()
    return event


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


async def _first_token_events(events: AsyncIterator[Event], deadline: _Deadline | None) -> list[Event]:
    """Pulls events up to and including the first that carries output, so the first frame is real."""
    head: list[Event] = []
    while True:
        try:
            event = await _next_event(events, deadline)
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
    fmt: WireFormat,
    observer: RequestObserver,
    *,
    include_usage: bool,
    headers: dict[str, str],
    timeouts: Timeouts | None = None,
    ping_seconds: float | None = 15.0,
    on_complete: Completion | None = None,
) -> Response:
    """SSE response. Errors before the first token are plain HTTP errors; any later failure is an error frame
    followed by ``[DONE]``. A client that leaves cancels the request's task wherever it waits (``DisconnectWatch``),
    and the event iterator is closed, which aborts the backend's work."""
    deadline = _Deadline(timeouts) if timeouts else None
    watch = DisconnectWatch(request.receive)
    try:
        head = await _first_token_events(events, deadline)
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: the request just ends here
        raise
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
        waits = _WaitDeadline(deadline) if deadline is not None else None
        output, frame_of = observer.output, fmt.frame
        burst: list[bytes] = []
        event: Event | None
        try:
            for event in head:  # the first token goes out at once
                frame = render(event)
                if frame is not None:
                    burst.append(frame)
            if burst:
                yield b"".join(burst)
                burst.clear()
            while True:
                try:
                    event = reader.ready()
                    if event is None:  # the backend has nothing more for now: send what it had, then wait
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
            error = APIError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error", code="internal_error")
            burst.append(fmt.error_frame(public_error(error, request)))
        finally:
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

    return EventStreamResponse(
        frames(),
        watch,
        lambda stalled: _record(observer, outcome, stalled),
        headers=headers,
        ping_seconds=ping_seconds,
        ping_frame=fmt.ping_frame,
        stall_timeout=timeouts.stall if timeouts else None,
    )


async def whole_response(
    request: Request,
    events: EventStream[Event],
    fmt: WireFormat,
    observer: RequestObserver,
    *,
    want_logprobs: bool,
    headers: dict[str, str],
    timeouts: Timeouts | None = None,
    on_complete: Completion | None = None,
) -> Response:
    deadline = _Deadline(timeouts) if timeouts else None

    async def collect() -> Usage | None:
        usage = None
        async for event in events:
            if deadline is not None:
                deadline.last = deadline.loop.time()  # the idle part of the deadline restarts at each event
            if isinstance(event, Usage):
                usage = event
            else:
                if isinstance(event, Delta):
                    observer.output(event.tokens, event.prompt_tokens)
                fmt.add(event)
        return usage

    async def collect_within() -> Usage | None:
        if deadline is None:
            return await collect()
        async with _Expiry(deadline):
            return await collect()

    watch = DisconnectWatch(request.receive)
    try:
        usage = await collect_within()
    except BaseException as exc:
        if await _ended_early(watch, events, observer, exc):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    watch.close()
    await events.aclose()
    body = orjson.dumps(fmt.response(usage, want_logprobs))
    if on_complete is not None:
        await on_complete(usage)
    observer.finish(200, usage)
    return Response(body, media_type="application/json", headers=headers)


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
    prompt_tokens = completion_tokens = 0
    async with aclosing(interleave(streams)) as merged:
        async for index, event in merged:
            if isinstance(event, Usage):
                prompt_tokens += event.prompt_tokens
                completion_tokens += event.completion_tokens
            else:
                yield event._replace(index=index * n + event.index)
    yield Usage(prompt_tokens, completion_tokens)

"""Running a backend's event stream for one HTTP request: SSE or a whole response, and client disconnects.

Starlette does not cancel a handler when its client goes away, so every wait that can be long (the first
token, a whole non-streamed completion) races against the ``http.disconnect`` message. When the client
wins, the event iterator is closed, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, NamedTuple, Protocol, TypeVar

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from backends.errors import BackendError, BackendTimeoutError
from backends.interface import Delta, Event, Finish, PromptEcho, Usage
from backends.streams import interleave
from gateway.errors import APIError, api_error_from_backend
from gateway.metrics import RequestObserver

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


class ClientDisconnectedError(Exception):
    pass


class Timeouts(NamedTuple):
    total: float | None  # seconds from arrival to the last token
    idle: float | None  # seconds between two events (the first token included)


class _Deadline:
    """A request's deadline: its total deadline, or ``idle`` after the last event, whichever comes first."""

    __slots__ = ("_end", "_idle", "_loop", "_timeouts", "last")

    def __init__(self, timeouts: Timeouts) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeouts = timeouts
        now = self._loop.time()
        self._end = now + timeouts.total if timeouts.total else None
        self._idle = timeouts.idle
        self.last = now

    def next(self) -> float | None:
        idle_end = self.last + self._idle if self._idle else None
        if self._end is None:
            return idle_end
        return self._end if idle_end is None else min(self._end, idle_end)

    def expired(self) -> BackendTimeoutError:
        if self._end is not None and self._loop.time() >= self._end:
            return BackendTimeoutError(f"The request took longer than its {self._timeouts.total:g} s deadline.")
        return BackendTimeoutError(f"No output from the backend for {self._timeouts.idle:g} s.")


async def _next_event(events: AsyncIterator[Event], deadline: _Deadline | None) -> Event:
    """The next event, or ``BackendTimeoutError`` once the deadline passes (the backend's work is aborted,
    since the timeout cancels the iterator's pending await and its cleanup runs). The timeout only ever spans
    the wait for the backend, never a send to the client."""
    if deadline is None:
        return await anext(events)
    at = deadline.next()
    if at is None:
        event = await anext(events)
    else:
        try:
            async with asyncio.timeout_at(at):
                event = await anext(events)
        except TimeoutError:
            raise deadline.expired() from None
    deadline.last = deadline._loop.time()
    return event


class OpenAIFormat(Protocol):
    done_frame: bytes | None  # the stream's last frame (chat and completions: [DONE])

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None: ...
    def usage_frame(self, usage: Usage) -> bytes: ...
    def error_frame(self, error: APIError) -> bytes: ...
    def add(self, event: Delta | Finish | PromptEcho) -> None: ...
    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]: ...


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Awaits ``awaitable`` unless the client disconnects first, in which case it is cancelled."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():  # the client left, or we are cancelled: stop the work and let it close its iterator
            work.cancel()
            await asyncio.wait((work,))
    if work.cancelled():
        raise ClientDisconnectedError
    return work.result()


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


async def stream_response(
    request: Request,
    events: AsyncIterator[Event],
    fmt: OpenAIFormat,
    observer: RequestObserver,
    *,
    include_usage: bool,
    headers: dict[str, str],
    timeouts: Timeouts | None = None,
) -> Response:
    """SSE response. Errors before the first token are plain HTTP errors; later ones are an error frame
    followed by ``[DONE]``."""
    deadline = _Deadline(timeouts) if timeouts else None
    try:
        head = await unless_disconnected(request, _first_token_events(events, deadline))
    except BaseException as exc:
        await events.aclose()
        _observe_failure(observer, exc)
        raise

    async def frames() -> AsyncIterator[bytes]:
        usage: Usage | None = None
        status = 200
        code: str | None = None

        def render(event: Event) -> bytes | None:
            nonlocal usage
            if isinstance(event, Usage):
                usage = event
                return fmt.usage_frame(event) if include_usage else None
            if isinstance(event, Delta):
                observer.first_token()
            return fmt.frame(event)

        try:
            for event in head:
                frame = render(event)
                if frame is not None:
                    yield frame
            while True:
                try:
                    event = await _next_event(events, deadline)
                except StopAsyncIteration:
                    break
                frame = render(event)
                if frame is not None:
                    yield frame
        except BackendError as exc:
            error = api_error_from_backend(exc)
            status, code = error.status, error.code or error.type
            yield fmt.error_frame(error)
        except (asyncio.CancelledError, GeneratorExit):
            status, code = CLIENT_CLOSED_REQUEST, "client_disconnected"
            raise
        finally:
            await events.aclose()
            observer.finish(status, usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0, code)
        if fmt.done_frame is not None:
            yield fmt.done_frame

    return EventSourceResponse(frames(), headers=headers, ping=15)


async def whole_response(
    request: Request,
    events: AsyncIterator[Event],
    fmt: OpenAIFormat,
    observer: RequestObserver,
    *,
    want_logprobs: bool,
    headers: dict[str, str],
    timeouts: Timeouts | None = None,
) -> Response:
    deadline = _Deadline(timeouts) if timeouts else None

    async def collect() -> Usage | None:
        usage = None
        while True:
            try:
                event = await _next_event(events, deadline)
            except StopAsyncIteration:
                return usage
            if isinstance(event, Usage):
                usage = event
            else:
                if isinstance(event, Delta):
                    observer.first_token()
                fmt.add(event)

    try:
        usage = await unless_disconnected(request, collect())
    except BaseException as exc:
        _observe_failure(observer, exc)
        raise
    finally:
        await events.aclose()
    observer.finish(200, usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)
    body = orjson.dumps(fmt.response(usage, want_logprobs))
    return Response(body, media_type="application/json", headers=headers)


def _observe_failure(observer: RequestObserver, exc: BaseException) -> None:
    if isinstance(exc, ClientDisconnectedError | asyncio.CancelledError):
        observer.finish(CLIENT_CLOSED_REQUEST, code="client_disconnected")
    elif isinstance(exc, BackendError):
        error = api_error_from_backend(exc)
        observer.finish(error.status, code=error.code or error.type)
    else:
        observer.finish(500, code="internal_error")


async def merge_prompts(streams: list[AsyncIterator[Event]], n: int) -> AsyncIterator[Event]:
    """Runs one event stream per prompt concurrently, renumbering choices ``prompt_index * n + i`` and
    adding the usages up, as OpenAI does for a list of prompts."""
    prompt_tokens = completion_tokens = 0
    async for index, event in interleave(streams):
        if isinstance(event, Usage):
            prompt_tokens += event.prompt_tokens
            completion_tokens += event.completion_tokens
        else:
            yield event._replace(index=index * n + event.index)
    yield Usage(prompt_tokens, completion_tokens)

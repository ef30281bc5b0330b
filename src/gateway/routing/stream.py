"""One routed request's events: try targets in order until one produces its first event, then pass that
target's events through untouched.

The first event is the commit point. Until a target produced it, nothing can have reached the client
(``streaming`` sends headers only after the first token), so a target failure moves the request to the next
fallback. After it, a failure ends the request (an error frame on a stream): never a second answer.

Accounting happens once at the start and once at the end of a request (in-flight count, breaker, latency
window); per batch of events there is one extra method call and, until the first token, one type check per event.
A traced request has a span per attempt (``gateway.tracing.BackendCall``), which also sees every event, as does a
mirrored request's shadow comparison.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from backends.errors import (
    BackendError,
    BackendTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
)
from backends.interface import (
    NOT_OPENED,
    Backend,
    BatchStream,
    Delta,
    Event,
    EventStream,
    GenerateRequest,
    batches_of,
    never_notifies,
    notify_of,
)
from gateway.routing.shadow import CANCELLED, FAILED, OK, ShadowPair
from gateway.routing.targets import Target

if TYPE_CHECKING:
    from gateway.routing.model_router import ModelRoutes
    from gateway.tracing import BackendCall

EventFactory = Callable[[Backend], EventStream[Event]]
"""Opens the request's event stream on a given backend (called once per attempt, and once for the shadow)."""


def may_fall_back(exc: BackendError) -> bool:
    """Whether another target may succeed where this one failed: not for the client's own mistakes, and not
    after a timeout (the request's time is spent)."""
    return not isinstance(exc, InvalidRequestError | ModelNotFoundError | BackendTimeoutError)


def counts_against_target(exc: BackendError) -> bool:
    """Whether the failure says the target is broken (breaker): not the client's mistakes, not overload (a
    full target is healthy, and load-aware routing and fallbacks deal with it)."""
    return not isinstance(exc, InvalidRequestError | ModelNotFoundError | OverloadedError)


class RoutedStream:
    """The async iterator of events the gateway streams for one request (see the module docstring)."""

    __slots__ = (
        "_batches",
        "_breaker_trial",
        "_call",
        "_done",
        "_factory",
        "_first_token_at",
        "_holds_in_flight",
        "_inner",
        "_request",
        "_routes",
        "_shadow",
        "_started",
        "_target",
        "_tried",
        "_via",
        "_watching",
        "notify",
        "served_by",
        "wait",
    )

    def __init__(
        self,
        routes: ModelRoutes,
        target: Target,
        via: str,
        factory: EventFactory,
        shadow: ShadowPair | None,
        request: GenerateRequest | None = None,
    ) -> None:
        self._routes = routes
        self._factory = factory
        self._shadow = shadow
        self._request = request
        self._call: BackendCall | None = None
        self._inner: EventStream[Event] | None = None
        self._batches: BatchStream[Event] = NOT_OPENED
        self.wait: Callable[[], Awaitable[None]] = NOT_OPENED.wait
        """``BatchStream.wait``: the target's stream's own, once the request is committed to it."""
        self.notify: Callable[[Callable[[], None]], bool] = never_notifies
        """``Notifying.notify``: the target's stream's own too (its callback only wakes; ``ready`` is this one)."""
        self._done = False
        self._first_token_at: float | None = None
        self._watching = True
        self._started = time.perf_counter()
        self._tried: list[Target] = []
        self._target = target
        self._holds_in_flight = False
        self._breaker_trial = False  # the request is the breaker's trial of a target it had opened
        self.served_by: Callable[[Backend], None] | None = None
        """Called when a fallback target takes over, so the response can name the backend that served it."""
        self._send_to(target, via)

    @property
    def backend(self) -> Backend:
        """The target's backend: the chosen one, or after a fallback the one that took over."""
        return self._target.backend

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> Event:
        inner = self._inner
        if inner is None:
            if self._done:
                raise StopAsyncIteration
            return await self._open()
        try:
            event = await inner.__anext__()
        except StopAsyncIteration:
            self._end(None)
            await inner.aclose()  # frees what the target held (an admission slot)
            raise
        except BaseException as exc:
            self._end(exc)
            raise
        if self._watching:
            self._watch(event)
        return event

    def ready(self) -> list[Event]:
        """``BatchStream.ready`` of the target's stream, ending the request here as ``__anext__`` does."""
        try:
            batch = self._batches.ready()
        except StopAsyncIteration:
            self._end(None)  # the target's stream is closed by the consumer's aclose, which frees its slot
            raise
        except BaseException as exc:
            self._end(exc)
            raise
        if self._watching:
            for event in batch:
                self._watch(event)
        return batch

    async def aclose(self) -> None:
        """Ends the request early (client gone, deadline): the target's iterator is closed, aborting its work."""
        if not self._done:
            if self._inner is None:
                self._abandon_before_start()
            else:
                self._end(GeneratorExit())
        inner = self._inner
        if inner is not None:
            await inner.aclose()

    # ---- before the first event ----------------------------------------------------------------------------

    def _send_to(self, target: Target, via: str) -> None:
        self._target = target
        self._via = via
        self._tried.append(target)
        target.load.in_flight += 1
        self._holds_in_flight = True
        target.requests += 1
        self._breaker_trial = target.breaker.acquire()
        counter = target.routed.get(via)
        if counter is None:
            counter = target.routed[via] = self._routes.metrics.routed.labels(target.model, target.name, via)
        counter.inc()

    async def _open(self) -> Event:
        while True:
            target = self._target
            self._started = time.perf_counter()
            if self._shadow is not None:
                self._shadow.primary.started = self._started
            inner: EventStream[Event] | None = None
            tracing = self._routes.tracing
            call = self._call = tracing.backend_call(target.backend, self._request, self._via) if tracing else None
            try:
                inner = self._factory(target.backend if call is None else call.backend)
                event = await inner.__anext__()
            except StopAsyncIteration:
                self._inner = inner
                target.breaker.answered()
                self._end(None)
                assert inner is not None  # the factory returned: its stream ended before a first event
                await inner.aclose()
                raise
            except BackendError as exc:
                self._failed_before_first_event(target, exc)
                if inner is not None:
                    await inner.aclose()
                following = self._routes.next_fallback(self._tried) if may_fall_back(exc) else None
                if call is not None:
                    call.end(exc, following.name if following is not None else None)
                if following is None:
                    self._finish_unserved(FAILED)
                    raise
                self._send_to(following, "fallback")
                if self.served_by is not None:
                    self.served_by(following.backend)
                continue
            except BaseException as exc:  # cancelled (client gone, deadline) or a bug: nothing is known of the target
                if call is not None:
                    call.end(exc)
                self._abandon_before_start()
                if inner is not None:
                    await inner.aclose()
                raise
            self._inner = inner
            self._batches = batches_of(inner)
            self.wait = self._batches.wait
            self.notify = notify_of(self._batches)
            target.breaker.answered()
            self._watch(event)
            return event

    def _release(self) -> None:
        """Gives the target's in-flight slot back, once, whichever way the request ends."""
        if self._holds_in_flight:
            self._holds_in_flight = False
            self._target.load.in_flight -= 1

    def _failed_before_first_event(self, target: Target, exc: BackendError) -> None:
        self._release()
        if counts_against_target(exc):
            target.breaker.failed()
            target.failures += 1
            self._routes.metrics.target_failures.labels(target.model, target.name, "before_first_event").inc()
        elif self._breaker_trial:
            target.breaker.released()
        self._breaker_trial = False

    def _abandon_before_start(self) -> None:
        self._release()
        if self._breaker_trial:
            self._target.breaker.released()
            self._breaker_trial = False
        self._finish_unserved(CANCELLED)

    def _finish_unserved(self, outcome: str) -> None:
        self._done = True
        if self._shadow is not None:
            self._shadow.primary_ended(outcome, self._target.name)

    # ---- after the first event -----------------------------------------------------------------------------

    def _watch(self, event: Event) -> None:
        """Until the first token (for the latency window), and for mirrored or traced requests."""
        shadow = self._shadow
        if self._first_token_at is None and type(event) is Delta:
            self._first_token_at = time.perf_counter()
        if shadow is not None:
            shadow.primary.observe(event)
        call = self._call
        if call is not None:
            call.observe(event)
        self._watching = shadow is not None or call is not None or self._first_token_at is None

    def _end(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self._release()
        if self._call is not None:
            self._call.end(exc)
        target = self._target
        if exc is None:
            outcome = OK
            target.breaker.succeeded()
            target.e2e.add(time.perf_counter() - self._started)
            if self._first_token_at is not None:
                target.ttft.add(self._first_token_at - self._started)
        elif isinstance(exc, BackendError):
            outcome = FAILED
            if counts_against_target(exc):
                target.breaker.failed()
                target.failures += 1
                self._routes.metrics.target_failures.labels(target.model, target.name, "mid_stream").inc()
        else:
            outcome = CANCELLED
        if self._shadow is not None:
            self._shadow.primary_ended(outcome, target.name)

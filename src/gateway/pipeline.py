"""One generation request's path through the gateway, from a validated body to the bytes of its answer:

    request -> limits -> route -> admission -> backend -> stream

A route module (chat, completions, Messages, Responses) validates its API's body, builds the one normalized
``GenerateRequest`` and a ``Reply`` (how its API writes events) and calls ``serve``, which takes the hops in order:

1. limits (``within_limits``): the key's request and token budgets admit the request and reserve its tokens
   (``gateway.limits``); whichever way it ends, what it used is settled.
2. route (``route``): the model's policy picks a target, with pinning, breakers, fallbacks and a shadow
   (``gateway.routing.model_router``). The routed stream is lazy: nothing has run on a backend yet.
3. admission and 4. backend (``backend_events``): on its first read the routed stream opens the request's events on
   its target. That target's backend is wrapped by its admission gate at start-up (``gateway.admission``), so the
   open first waits for a slot in flow control's queues, then the backend starts the work (an engine request or
   an upstream HTTP stream). A fallback repeats both on the next target, before any byte reached the client.
5. stream (``respond``): the events become SSE frames or one body in the API's format (``gateway.streaming``),
   under the request's deadlines, with disconnects aborting the backend's work and the request's metrics.

The socket below this (``gateway.server``, ``gateway.connections``) and the ASGI middleware around it
(``gateway.middleware``, ``gateway.auth``) are the same for every route; docs/architecture.md draws the whole path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from backends.interface import Backend, Event, EventStream, GenerateRequest, Usage
from gateway.capabilities import system_fingerprint
from gateway.deadlines import Timeouts
from gateway.gateway_state import GatewayState
from gateway.limits import KeyLimits, Reservation, reserved
from gateway.routing.stream import EventFactory, RoutedStream
from gateway.streaming import Completion, Serving, WireFormat, stream_response, whole_response

logger = logging.getLogger(__name__)


class Reply(NamedTuple):
    """How a route's API answers: its wire format (built for the serving backend's fingerprint) and options."""

    make_format: Callable[[str], WireFormat]
    stream: bool
    include_usage: bool
    want_logprobs: bool
    on_complete: Completion | None = None
    """Awaited with the usage before the last byte (the Responses API stores the response here)."""


async def serve(
    request: Request,
    state: GatewayState,
    generate: GenerateRequest,
    reply: Reply,
    *,
    reserve: int | None,
    prompt_tokens: int = 0,
    open_events: EventFactory | None = None,
) -> Response:
    """The hops of the module docstring, in order. ``reserve``: the output tokens to reserve (None: the default);
    ``prompt_tokens``: prompt the body does not carry (a stored conversation); ``open_events``: how hops 3 and 4
    open a backend's events when one request is several (completions' prompts), else ``backend_events``."""
    async with within_limits(request, state, reserve, prompt_tokens, messages=generate.messages) as reservation:
        events = route(request, state, generate, open_events or backend_events(generate))
        return await respond(request, state, events, reply, reservation, model=generate.model)


def within_limits(
    request: Request,
    state: GatewayState,
    reserve: int | None,
    prompt_tokens: int = 0,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
) -> AbstractAsyncContextManager[Reservation]:
    """Hop 1: the key's budgets admit the request (a 429 when spent), its chat ``messages``' images estimated at
    their bound; leaving the block before a backend took the request over gives the reservation back."""
    return reserved(request, key_limits(state), reserve, prompt_tokens=prompt_tokens, messages=messages)


def route(request: Request, state: GatewayState, generate: GenerateRequest, open_events: EventFactory) -> RoutedStream:
    """Hop 2: the target the model's routing picks; 404 for an unknown model, 400 for a foreign pin, 503 when no
    target is available."""
    return state.router.route(generate.model, generate, request.headers, open_events)


def backend_events(generate: GenerateRequest) -> EventFactory:
    """Hops 3 and 4, run by the routed stream on the target it chose: the target's backend (its admission gate's
    wrapper) waits for a slot, then opens the request's events."""

    def open_events(backend: Backend) -> EventStream[Event]:
        return backend.generate(generate)

    return open_events


async def respond(
    request: Request, state: GatewayState, events: RoutedStream, reply: Reply, reservation: Reservation, *, model: str
) -> Response:
    """Hop 5: the routed events sent as SSE or as one response, observed (metrics by model and serving backend)
    and settled against the key's budgets when they end."""
    limits = key_limits(state)
    observer = state.metrics.observer(model, events.backend.name, request.state.log)
    observer.on_finish = functools.partial(limits.settle_soon, reservation, log=observer.log)
    events.served_by = lambda backend: observer.rebind(backend.name)  # a fallback counts the request from then on

    def serving() -> Serving:
        return _serving(events.backend, reply.make_format, reservation)

    async def completed(usage: Usage | None) -> None:
        """Before the last byte: the response is stored (Responses API) and the key's budget settled. A failure
        here is a bug (store failures are handled below), logged; the client still gets its whole response."""
        try:
            if reply.on_complete is not None:
                await reply.on_complete(usage)
            await limits.settle(reservation, observer.cost(200, usage), observer.log)
        except Exception:
            logger.exception("finishing request %s failed", request.state.request_id)

    timeouts = _timeouts(state)
    if reply.stream:
        ping = state.config.server.streams.ping_seconds
        return await stream_response(
            request,
            events,
            serving,
            observer,
            include_usage=reply.include_usage,
            timeouts=timeouts,
            ping_seconds=ping,
            on_complete=completed,
        )
    return await whole_response(
        request, events, serving, observer, want_logprobs=reply.want_logprobs, timeouts=timeouts, on_complete=completed
    )


def key_limits(state: GatewayState) -> KeyLimits:
    assert state.limits is not None, "the app's lifespan sets the key limits before it serves"
    return state.limits


def _timeouts(state: GatewayState) -> Timeouts:
    streams = state.config.server.streams
    return Timeouts(streams.request_timeout, streams.idle_timeout, streams.stall_timeout)


def _serving(backend: Backend, make_format: Callable[[str], WireFormat], reservation: Reservation) -> Serving:
    """The response's format and headers for the backend that serves it: asked for once the first event is in,
    so after any fallback (the routed stream's ``backend`` is then the one that took over)."""
    return Serving(make_format(system_fingerprint(backend)), {"X-Backend": backend.name, **reservation.headers})

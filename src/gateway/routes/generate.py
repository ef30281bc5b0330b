"""``/v1/chat/completions`` and ``/v1/completions``: OpenAI JSON in, backend events out, OpenAI JSON back."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from starlette.responses import Response

from backends.interface import Backend, Event, EventStream, GenerateRequest, Usage
from gateway.auth import request_label, request_service_tier
from gateway.bodies import OffloadedJSONRoute
from gateway.capabilities import system_fingerprint
from gateway.deadlines import Timeouts
from gateway.errors import APIError
from gateway.limits import KeyLimits, Reservation, admitted
from gateway.metrics import RequestObserver
from gateway.openai.output import ChatFormat, CompletionFormat
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing.stream import RoutedStream
from gateway.state import GatewayState, gateway_state
from gateway.streaming import Completion, merge_prompts, stream_response, whole_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["generation"], route_class=OffloadedJSONRoute)  # 7 MiB bodies are parsed off the loop

MAX_PROMPTS = 64


def _check_n(n: int, state: GatewayState) -> None:
    if n > state.config.server.max_n:
        raise APIError(400, f"n must be at most {state.config.server.max_n}.", param="n")


def _limits(state: GatewayState) -> KeyLimits:
    assert state.limits is not None
    return state.limits


def _timeouts(state: GatewayState) -> Timeouts:
    server = state.config.server
    return Timeouts(server.request_timeout, server.idle_timeout, server.stall_timeout)


def _served_by(
    fmt: ChatFormat | CompletionFormat, observer: RequestObserver, headers: dict[str, str]
) -> Callable[[Backend], None]:
    """When a fallback takes a request over (before its first token, so before any header or frame is sent),
    the response and its metrics name the backend that served it."""

    def switch(backend: Backend) -> None:
        fmt.fingerprint = system_fingerprint(backend)
        observer.rebind(backend.name)
        headers["X-Backend"] = backend.name

    return switch


async def _respond(
    request: Request,
    state: GatewayState,
    events: RoutedStream,
    make_format: Callable[[str], ChatFormat | CompletionFormat],
    *,
    model: str,
    reservation: Reservation,
    stream: bool,
    include_usage: bool,
    want_logprobs: bool,
    on_complete: Completion | None = None,
) -> Response:
    """Observes, labels and sends the routed event stream as SSE or as one response."""
    backend = events.backend
    fmt = make_format(system_fingerprint(backend))
    limits = _limits(state)
    observer = state.metrics.observer(model, backend.name, request.state.log)
    observer.on_finish = functools.partial(limits.settle_soon, reservation, log=observer.log)
    headers = {"X-Backend": backend.name, **reservation.headers}
    events.served_by = _served_by(fmt, observer, headers)
    timeouts = _timeouts(state)

    async def completed(usage: Usage | None) -> None:
        """Before the last byte: the response is stored (Responses API) and the key's budget settled. A failure
        here is a bug (store failures are handled below), logged; the client still gets its whole response."""
        try:
            if on_complete is not None:
                await on_complete(usage)
            await limits.settle(reservation, observer.cost(200, usage), observer.log)
        except Exception:
            logger.exception("finishing request %s failed", request.state.request_id)

    if stream:
        return await stream_response(
            request,
            events,
            fmt,
            observer,
            include_usage=include_usage,
            headers=headers,
            timeouts=timeouts,
            ping_seconds=state.config.server.ping_seconds,
            on_complete=completed,
        )
    return await whole_response(
        request,
        events,
        fmt,
        observer,
        want_logprobs=want_logprobs,
        headers=headers,
        timeouts=timeouts,
        on_complete=completed,
    )


@router.post("/v1/chat/completions", response_model=None)
@router.post("/beta/chat/completions", response_model=None, include_in_schema=False)  # DeepSeek's beta base URL
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    _check_n(body.n, state)
    server = state.config.server
    if len(body.messages) > server.max_messages:
        raise APIError(400, f"at most {server.max_messages} messages are allowed.", param="messages")
    if body.tools and len(body.tools) > server.max_tools:
        raise APIError(400, f"at most {server.max_tools} tools are allowed.", param="tools")
    problem = body.tool_choice_problem()
    if problem is not None:
        raise APIError(400, problem, param="tool_choice")
    model = state.router.served_name(body.model)
    label = request_label(request)
    tier = request_service_tier(request, state.key_tiers.tier_for(label, body.service_tier))
    limit = body.output_limit()
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    reserve = limit * body.n if limit is not None else None
    async with admitted(request, _limits(state), reserve, messages=messages) as reservation:
        generate = GenerateRequest(
            request_id=request.state.request_id,
            model=model,
            messages=messages,
            sampling=body.sampling_options(
                max_tokens=body.output_limit(), logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0
            ),
            n=body.n,
            max_buffered_tokens=server.stream_buffer_tokens,
            user=body.user if body.user is not None else body.user_id,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=body.response_format,
            thinking=body.thinking.enabled if body.thinking is not None else None,
            reasoning_effort=body.reasoning_effort,
            chat_template_kwargs=body.chat_template_kwargs,
            service_tier=tier,
            priority=body.priority,
            tenant=label,
            log=request.state.log,
        )
        events = state.router.route(model, generate, request.headers, lambda b: b.generate(generate))
        return await _respond(
            request,
            state,
            events,
            lambda fingerprint: ChatFormat(
                f"chatcmpl-{os.urandom(16).hex()}", int(time.time()), model, fingerprint, body.n, tier
            ),
            model=model,
            reservation=reservation,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=body.logprobs,
        )


@router.post("/v1/completions", response_model=None)
@router.post("/beta/completions", response_model=None, include_in_schema=False)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    _check_n(body.n, state)
    prompts = body.prompts()
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts are allowed in one request.", param="prompt")
    model = state.router.served_name(body.model)
    label = request_label(request)
    tier = request_service_tier(request, state.key_tiers.tier_for(label, body.service_tier))
    reserve = body.max_tokens * len(prompts) * body.n if body.max_tokens is not None else None
    async with admitted(request, _limits(state), reserve) as reservation:
        sampling = body.sampling_options(
            max_tokens=body.max_tokens, logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0
        )
        requests = [
            GenerateRequest(
                request_id=request.state.request_id,
                model=model,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                sampling=sampling,
                n=body.n,
                echo=body.echo,
                max_buffered_tokens=state.config.server.stream_buffer_tokens,
                user=body.user,
                service_tier=tier,
                priority=body.priority,
                tenant=label,
                log=request.state.log,
            )
            for prompt in prompts
        ]

        def open_events(backend: Backend) -> EventStream[Event]:
            streams = [backend.generate(r) for r in requests]
            return streams[0] if len(streams) == 1 else merge_prompts(streams, body.n)

        events = state.router.route(model, requests[0], request.headers, open_events)
        choices = len(prompts) * body.n
        return await _respond(
            request,
            state,
            events,
            lambda fingerprint: CompletionFormat(
                f"cmpl-{os.urandom(16).hex()}", int(time.time()), model, fingerprint, choices, tier
            ),
            model=model,
            reservation=reservation,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=body.logprobs is not None,
        )

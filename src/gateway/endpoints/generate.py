"""``/v1/chat/completions`` and ``/v1/completions``: OpenAI JSON in, validated and made a ``GenerateRequest``; the
rest of the way is ``gateway.pipeline``'s."""

from __future__ import annotations

import logging
import os
import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from backends.interface import Backend, Event, EventStream, GenerateRequest
from gateway.auth import request_label, request_service_tier
from gateway.bodies import OffloadedJSONRoute
from gateway.errors import APIError
from gateway.gateway_state import GatewayState, gateway_state
from gateway.openai.output import ChatFormat, CompletionFormat
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.pipeline import Reply, serve
from gateway.streaming import merge_prompts

logger = logging.getLogger(__name__)
router = APIRouter(tags=["generation"], route_class=OffloadedJSONRoute)  # 7 MiB bodies are parsed off the loop

MAX_PROMPTS = 64


def _check_n(n: int, state: GatewayState) -> None:
    if n > state.config.server.limits.max_n:
        raise APIError(400, f"n must be at most {state.config.server.limits.max_n}.", param="n")


@router.post("/v1/chat/completions", response_model=None)
@router.post("/beta/chat/completions", response_model=None, include_in_schema=False)  # DeepSeek's beta base URL
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    _check_n(body.n, state)
    server = state.config.server
    if len(body.messages) > server.limits.max_messages:
        raise APIError(400, f"at most {server.limits.max_messages} messages are allowed.", param="messages")
    if body.tools and len(body.tools) > server.limits.max_tools:
        raise APIError(400, f"at most {server.limits.max_tools} tools are allowed.", param="tools")
    problem = body.tool_choice_problem()
    if problem is not None:
        raise APIError(400, problem, param="tool_choice")
    model = state.router.served_name(body.model)
    label = request_label(request)
    tier = request_service_tier(request, state.key_tiers.tier_for(label, body.service_tier))
    limit = body.output_limit()
    generate = GenerateRequest(
        request_id=request.state.request_id,
        model=model,
        messages=[m.model_dump(exclude_none=True) for m in body.messages],
        sampling=body.sampling_options(max_tokens=limit, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0),
        n=body.n,
        max_buffered_tokens=server.streams.stream_buffer_tokens,
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
    reply = Reply(
        lambda fingerprint: ChatFormat(
            f"chatcmpl-{os.urandom(16).hex()}", int(time.time()), model, fingerprint, body.n, tier
        ),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        want_logprobs=body.logprobs,
    )
    return await serve(request, state, generate, reply, reserve=limit * body.n if limit is not None else None)


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
            max_buffered_tokens=state.config.server.streams.stream_buffer_tokens,
            user=body.user,
            service_tier=tier,
            priority=body.priority,
            tenant=label,
            log=request.state.log,
        )
        for prompt in prompts
    ]

    def open_events(backend: Backend) -> EventStream[Event]:
        """Every prompt is its own request on the one target chosen for the first, merged into one stream."""
        streams = [backend.generate(r) for r in requests]
        return streams[0] if len(streams) == 1 else merge_prompts(streams, body.n)

    choices = len(prompts) * body.n
    reply = Reply(
        lambda fingerprint: CompletionFormat(
            f"cmpl-{os.urandom(16).hex()}", int(time.time()), model, fingerprint, choices, tier
        ),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        want_logprobs=body.logprobs is not None,
    )
    return await serve(request, state, requests[0], reply, reserve=reserve, open_events=open_events)

"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, served through the chat machinery.

A request becomes a chat ``GenerateRequest`` (``gateway.anthropic.translate``) and is routed, admitted, limited by
its key's budgets, observed (metrics by model and backend) and aborted on disconnect exactly as a chat completion
is; its events come back as Anthropic content blocks and stream events (``gateway.anthropic.output``). Errors are
Anthropic-shaped on these paths (``gateway.anthropic.errors``). ``anthropic-version`` and ``anthropic-beta`` are
accepted; betas change nothing but the ``thinking.budget_tokens`` rule (docs/anthropic.md).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from backends.errors import ContextLengthExceededError, InvalidRequestError
from gateway.anthropic.output import MessagesFormat, new_id
from gateway.anthropic.protocol import ConversationRequest, CountTokensRequest, MessagesRequest
from gateway.anthropic.signatures import ThinkingSigner
from gateway.anthropic.translate import generate_request, messages_terms
from gateway.auth import request_label
from gateway.bodies import OffloadedJSONRoute
from gateway.counting import count_prompt
from gateway.endpoints.tokenize import _counted
from gateway.errors import APIError
from gateway.gateway_state import GatewayState, gateway_state
from gateway.pipeline import Reply, serve

router = APIRouter(tags=["messages"], route_class=OffloadedJSONRoute)  # Claude Code sends 50 KB and more

INTERLEAVED_THINKING_BETA = "interleaved-thinking-"
TOO_LONG = "prompt is too long: "
"""Anthropic's words for a prompt that does not fit, which clients such as Claude Code look for."""


def _signer(state: GatewayState) -> ThinkingSigner:
    assert state.thinking_signer is not None
    return state.thinking_signer


def _check_size(body: ConversationRequest, state: GatewayState) -> None:
    server = state.config.server
    if len(body.messages) > server.limits.max_messages:
        raise APIError(400, f"at most {server.limits.max_messages} messages are allowed.", param="messages")
    if body.tools and len(body.tools) > server.limits.max_tools:
        raise APIError(400, f"at most {server.limits.max_tools} tools are allowed.", param="tools")


def _in_messages_terms(exc: InvalidRequestError) -> InvalidRequestError:
    """A backend's refusal, worded for a Messages client."""
    exc.message = messages_terms(exc.message)
    if isinstance(exc, ContextLengthExceededError) and not exc.message.startswith(TOO_LONG):
        exc.message = TOO_LONG + exc.message
    return exc


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = gateway_state(request)
    _check_size(body, state)
    betas = request.headers.get("anthropic-beta", "")
    problem = body.budget_problem(interleaved=INTERLEAVED_THINKING_BETA in betas)
    if problem is not None:
        raise APIError(400, problem, param="thinking.budget_tokens")
    model = state.router.served_name(body.model)
    generate = generate_request(
        body,
        request_id=request.state.request_id,
        model=model,
        signer=_signer(state),
        max_buffered_tokens=state.config.server.streams.stream_buffer_tokens,
    )
    # Anthropic's auto is the key's default tier; standard_only is the default tier when the key may use it.
    generate.tenant = request_label(request)
    asked = "default" if body.service_tier == "standard_only" else None
    generate.service_tier = state.key_tiers.tier_for(generate.tenant, asked)
    generate.log = request.state.log
    wire = MessagesFormat(
        new_id("msg"),
        model,
        max_tokens=body.max_tokens,
        signer=_signer(state),
        omit_thinking=body.reasoning_display_omitted(),
        service_tier=generate.service_tier,
    )
    # The usage ends a Messages stream: it carries message_delta.
    reply = Reply(lambda _fingerprint: wire, stream=body.stream, include_usage=True, want_logprobs=False)
    try:
        return await serve(request, state, generate, reply, reserve=body.max_tokens)
    except InvalidRequestError as exc:
        raise _in_messages_terms(exc) from None


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The ``input_tokens`` ``/v1/messages`` reports for the same request, from a target chosen as for any request
    (the model's policy, pinning, breakers, fallbacks) and within the key's budgets (``gateway.counting``)."""
    state = gateway_state(request)
    with _counted(state, "count_tokens"):
        _check_size(body, state)
        model = state.router.served_name(body.model)
        generate = generate_request(
            body, request_id=request.state.request_id, model=model, signer=_signer(state), max_buffered_tokens=None
        )
        generate.tenant = request_label(request)
        generate.log = request.state.log
        try:
            counted = await count_prompt(request, state, generate)
        except InvalidRequestError as exc:
            raise _in_messages_terms(exc) from None
    body_out: dict[str, Any] = {"input_tokens": counted.tokens}
    return Response(orjson.dumps(body_out), media_type="application/json", headers=counted.headers)

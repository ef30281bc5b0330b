"""``/v1/responses``: the Responses API, served through the chat machinery, with stored responses.

A request becomes a chat ``GenerateRequest`` (its input items, and those of the responses it continues, as chat
messages), is routed, admitted, observed and streamed exactly as a chat completion is, and its events come back
as Responses output items. Stored responses live in ``state.responses`` (``server.stores.responses_store``) and belong
to the tenant that created them: another tenant's id gets the answer an unknown id gets (404 here, and
``previous_response_not_found`` when continued), so a response's existence is not revealed either. The admin key
reads none of them (it is for operating the gateway, not for reading tenants' conversations).
"""

from __future__ import annotations

import time
from typing import Any, Literal, NamedTuple

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from backends.errors import InvalidRequestError
from backends.interface import GenerateRequest, Usage
from gateway.auth import request_label, request_owner, request_service_tier
from gateway.bodies import OffloadedJSONRoute
from gateway.errors import APIError
from gateway.gateway_state import GatewayState, gateway_state
from gateway.pipeline import Reply, serve
from gateway.responses.output import ResponsesFormat, response_envelope
from gateway.responses.protocol import (
    CreateResponseRequest,
    chat_messages,
    new_id,
    responses_message,
    responses_param,
    unmatched_call_output,
)
from gateway.responses.records import StoredResponse
from gateway.responses.store import StoredResponses

router = APIRouter(tags=["responses"], route_class=OffloadedJSONRoute)  # large inputs are parsed off the loop


def _stored(state: GatewayState) -> StoredResponses:
    assert state.responses is not None
    return state.responses


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")


async def _history(state: GatewayState, previous_id: str, owner: str) -> tuple[list[dict[str, Any]], int]:
    """The items of the conversation so far (each earlier response's input items, then its output) and the
    tokens they come to, as far as the last response's usage tells (its input was the whole conversation before
    it)."""
    chain = await _stored(state).chain(previous_id, owner, state.config.server.limits.max_messages)
    if chain is None:
        raise APIError(
            400,
            f"Previous response with id '{previous_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    items: list[dict[str, Any]] = []
    for record in chain:
        items.extend(record.input_items)
        items.extend(record.response["output"])
    usage = chain[-1].response.get("usage") if chain else None
    return items, usage["total_tokens"] if usage else 0


@router.post("/v1/responses", response_model=None)
async def create_response(body: CreateResponseRequest, request: Request) -> Response:
    state = gateway_state(request)
    owner = request_owner(request)
    messages, history_tokens = await _conversation(state, body, owner)
    model = state.router.served_name(body.model)
    response_id = new_id("resp")
    created_at = time.time()
    label = request_label(request)
    tier = request_service_tier(request, state.key_tiers.tier_for(label, body.service_tier))
    wire = ResponsesFormat(
        response_envelope(body, model, response_id, int(created_at), tier), want_logprobs=body.wants_logprobs()
    )
    reply = _reply(state, body, wire, _StoredKeys(response_id, created_at, owner))
    try:
        generate = _generate_request(request, body, model, messages, tier=tier, tenant=label)
        return await serve(
            request, state, generate, reply, reserve=body.max_output_tokens, prompt_tokens=history_tokens
        )
    except InvalidRequestError as exc:  # the backend names chat parameters: name them as this request did
        exc.message = responses_message(exc.message)
        exc.param = responses_param(exc.param) if exc.param is not None else None
        raise


async def _conversation(
    state: GatewayState, body: CreateResponseRequest, owner: str
) -> tuple[list[dict[str, Any]], int]:
    """The request's chat messages (the continued conversation's, then its own) and the tokens the conversation
    before it came to; refuses a bad tool_choice, an output for no call, or too many messages or tools."""
    server = state.config.server
    problem = body.tool_choice_problem()
    if problem is not None:
        raise APIError(400, problem, param="tool_choice")
    history, history_tokens = (
        await _history(state, body.previous_response_id, owner) if body.previous_response_id else ([], 0)
    )
    unmatched = unmatched_call_output(history, body.items)
    if unmatched is not None:
        position, call_id = unmatched
        raise APIError(
            400,
            f"No function call found for function_call_output with call_id '{call_id}'.",
            param=f"input[{position}]",
        )
    messages = chat_messages(body.instructions, history + body.items, len(history))
    if len(messages) > server.limits.max_messages:
        raise APIError(400, f"at most {server.limits.max_messages} messages are allowed.", param="input")
    if body.tools and len(body.tools) > server.limits.max_tools:
        raise APIError(400, f"at most {server.limits.max_tools} tools are allowed.", param="tools")
    return messages, history_tokens


class _StoredKeys(NamedTuple):
    """What a stored response is found by: its id, when it was created and the tenant that owns it."""

    response_id: str
    created_at: float
    owner: str


def _reply(state: GatewayState, body: CreateResponseRequest, wire: ResponsesFormat, keys: _StoredKeys) -> Reply:
    """How the pipeline answers: in the Responses wire format, with usage, storing the final response once
    complete if the request asks for that."""

    async def store(_usage: Usage | None) -> None:
        assert wire.final is not None
        record = StoredResponse(
            keys.response_id, keys.created_at, wire.final, body.items, body.previous_response_id, keys.owner
        )
        await _stored(state).save(record)

    return Reply(
        lambda _fingerprint: wire,
        stream=body.stream,
        include_usage=True,  # the terminal event carries the usage
        want_logprobs=body.wants_logprobs(),
        on_complete=store if body.stores() else None,
    )


def _generate_request(
    request: Request,
    body: CreateResponseRequest,
    model: str,
    messages: list[dict[str, Any]],
    *,
    tier: str,
    tenant: str,
) -> GenerateRequest:
    """The chat ``GenerateRequest`` that serves a Responses request."""
    return GenerateRequest(
        request_id=request.state.request_id,
        model=model,
        messages=messages,
        sampling=body.sampling_options(),
        user=body.user,
        tools=body.chat_tools(),
        tool_choice=body.chat_tool_choice(),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format(),
        reasoning_effort=body.reasoning_effort(),
        service_tier=tier,
        tenant=tenant,
        log=request.state.log,
    )


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request) -> Response:
    record = await _stored(gateway_state(request)).get(response_id, request_owner(request))
    if record is None:
        raise _not_found(response_id)
    return _json(record.response)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    if not await _stored(gateway_state(request)).delete(response_id, request_owner(request)):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Response:
    """The input items the response was created with (not those of the responses it continued)."""
    record = await _stored(gateway_state(request)).get(response_id, request_owner(request))
    if record is None:
        raise _not_found(response_id)
    items = record.input_items if order == "asc" else record.input_items[::-1]
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise APIError(400, f"No input item with id '{after}' in response '{response_id}'.", param="after")
        items = items[position + 1 :]
    page = items[:limit]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )

"""``/v1/models``: every name a client may send (served models and their aliases), with the kinds of backend
behind each."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.gateway_state import GatewayState, gateway_state

router = APIRouter(tags=["models"])


def _model_card(state: GatewayState, name: str) -> dict[str, Any]:
    """OpenAI's model object plus extensions (the schema allows extra fields): ``backend_kinds``, the kinds of
    backend that may answer; ``aliases`` on a served model, the other names it answers to; ``alias_of`` on an
    alias, the served model it stands for."""
    served = state.router.served_name(name)
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "deepinfer-gateway",
        "backend_kinds": state.router.backend_kinds(served),
    }
    if served == name:
        card["aliases"] = [alias for alias, model in state.router.aliases.items() if model == name]
    else:
        card["alias_of"] = served
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    names = [*state.router.model_names, *state.router.aliases]
    return {"object": "list", "data": [_model_card(state, name) for name in names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    return _model_card(gateway_state(request), model_id)  # a 404 for a name no model answers to

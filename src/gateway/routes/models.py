"""``/v1/models``: every served model name once, with the kinds of backend behind it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.errors import model_not_found
from gateway.state import GatewayState, gateway_state

router = APIRouter(tags=["models"])


def _model_card(state: GatewayState, name: str) -> dict[str, Any]:
    """OpenAI's model object plus ``backend_kinds``: the kinds of backend that may answer (an extension; the
    schema allows extra fields)."""
    return {
        "id": name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "deepinfer-gateway",
        "backend_kinds": state.router.backend_kinds(name),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.router.model_names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    if model_id not in state.router.model_names:
        raise model_not_found(model_id)
    return _model_card(state, model_id)

"""``/admin/targets``: the operator's view of routing. Everything under ``/admin/`` is protected by the admin
key (when one is configured) by the authentication middleware, not here."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.gateway_state import gateway_state

router = APIRouter(tags=["admin"])


@router.get("/admin/targets")
async def targets(request: Request) -> Response:
    """Every model's targets with health, in-flight requests, recent latency percentiles and circuit state,
    and its shadow comparison summary."""
    body = gateway_state(request).router.describe()
    return Response(orjson.dumps(body), media_type="application/json")

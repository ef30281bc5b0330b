"""Liveness, readiness and Prometheus metrics: for load balancers and operators, no auth."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.metrics import exposition
from gateway.state import gateway_state

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> Response:
    """Readiness: every backend has started and can take requests."""
    state = gateway_state(request)
    backends: dict[str, Any] = {}
    all_ready = True
    for name, backend in state.backends.items():
        ok, reason = backend.readiness()
        backends[name] = {"kind": backend.kind, "ready": ok, "reason": reason}
        all_ready = all_ready and ok
    for target in state.router.targets():  # detail only: an open circuit reroutes traffic, it does not unready
        entry = backends.get(target.backend.name)
        if entry is not None:
            entry.setdefault("circuits", {})[target.model] = target.breaker.state
    for name, error in state.start_errors.items():
        backends[name] = {"kind": backends.get(name, {}).get("kind"), "ready": False, "reason": error}
        all_ready = False
    if state.draining:
        all_ready = False
    status = "draining" if state.draining else "ready" if all_ready else "not_ready"
    body: dict[str, Any] = {"status": status, "backends": backends}
    if state.store is not None:  # detail only: while the store is down, limits fall back to local budgets
        body["state_store"] = state.store.readiness()
    return Response(orjson.dumps(body), status_code=200 if all_ready else 503, media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = gateway_state(request).metrics.registry
    return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

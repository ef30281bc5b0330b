"""Liveness, readiness and Prometheus metrics: for load balancers and operators, no auth.

``/ready`` follows what a load balancer needs to know: can this pod serve every model it serves? It is 503 while
the backends are starting, while draining, and when a model has no ready target at all (none of its backends or
fallbacks); a backend that is down while each of its models still has a ready target leaves the pod in rotation
(``degraded``), since every replica shares the upstreams and a probe that failed on one dead upstream would take
them all out at once. ``?strict=true`` asks for the stricter rule: 503 unless every backend is ready.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.auth import ADMIN_SCOPE
from gateway.errors import APIError
from gateway.gateway_state import GatewayState, gateway_state
from gateway.metrics import exposition

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


_FLAGS = {"true": True, "1": True, "false": False, "0": False}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> Response:
    """Readiness: started, not draining, and every model has a ready target (with ``?strict=true``: every backend
    is ready). Reasons with addresses and error text are shown only to a caller who may read ``/admin``."""
    raw = request.query_params.get("strict", "false")
    strict = _FLAGS.get(raw.lower())
    if strict is None:
        raise APIError(
            400, f"Invalid value for 'strict': {raw[:40]!r}; use true or false.", param="strict", code="invalid_value"
        )
    state = gateway_state(request)
    detail = bool(request.scope.get("state", {}).get(ADMIN_SCOPE))
    backends = _backends(state, detail)
    models: dict[str, Any] = {}
    for name in state.router.model_names:
        ready_targets = state.router.model_routes(name).ready_targets()
        models[name] = {"routable": bool(ready_targets), "ready_backends": [t.name for t in ready_targets]}
    if state.draining:
        status = "draining"
    elif not state.started:
        status = "starting"
    elif not all(m["routable"] for m in models.values()) or (strict and not all(b["ready"] for b in backends.values())):
        status = "not_ready"
    else:
        status = "ready" if all(b["ready"] for b in backends.values()) else "degraded"
    body: dict[str, Any] = {"status": status, "models": models, "backends": backends}
    if state.store is not None:  # detail only: while the store is down, limits fall back to local budgets
        store = state.store.readiness()
        body["state_store"] = store if detail else {"up": store["up"]}
    code = 200 if status in ("ready", "degraded") else 503
    return Response(orjson.dumps(body), status_code=code, media_type="application/json")


def _backends(state: GatewayState, detail: bool) -> dict[str, Any]:
    """Each backend's readiness, with its own reason (``detail``) or a generic one (no addresses, no errors)."""
    backends: dict[str, Any] = {}
    for name, backend in state.backends.items():
        ok, reason = backend.readiness()
        failed = state.start_errors.get(name)
        if failed is not None:
            ok, reason = False, failed
        if not detail:
            reason = "ready" if ok else "failed to start" if failed else "not ready" if state.started else "starting"
        backends[name] = {"kind": backend.kind, "ready": ok, "reason": reason}
    for target in state.router.targets():  # detail only: an open circuit reroutes traffic, it does not unready
        backends[target.backend.name].setdefault("circuits", {})[target.model] = target.breaker.state
    return backends


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = gateway_state(request).metrics.registry
    return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

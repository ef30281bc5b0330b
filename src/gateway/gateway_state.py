"""What the routes share: config, backends, router, metrics. Built by ``create_app``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from backends.interface import Backend
from gateway.anthropic.signatures import ThinkingSigner
from gateway.config import GatewayConfig
from gateway.flow_control import KeyTiers
from gateway.limits import KeyLimits
from gateway.metrics import GatewayMetrics
from gateway.responses.store import StoredResponses
from gateway.routing.model_router import ModelRouter
from gateway.shared_store import SharedStateStore

if TYPE_CHECKING:
    from gateway.batches.runner import BatchRunner
    from gateway.tracing import Tracing


@dataclass
class GatewayState:
    config: GatewayConfig
    backends: dict[str, Backend]
    router: ModelRouter
    metrics: GatewayMetrics
    started_at: int = field(default_factory=lambda: int(time.time()))
    start_errors: dict[str, str] = field(default_factory=dict)
    limits: KeyLimits | None = None
    key_tiers: KeyTiers = field(default_factory=lambda: KeyTiers([]))
    """Each API key's service tiers, default tier and weight (``server.auth.api_keys``)."""
    responses: StoredResponses | None = None
    """Stored Responses API responses (``server.stores.responses_store``)."""
    store: SharedStateStore | None = None
    """The shared state store (``server.stores.state_store``), if one is configured."""
    started: bool = False
    """Set once every backend's start has returned or failed: until then /ready is 503 (starting)."""
    thinking_signer: ThinkingSigner | None = None
    """Signs and checks the thinking blocks of ``/v1/messages`` (``server.auth.thinking_signature_key``)."""
    tracing: Tracing | None = None
    """OpenTelemetry traces (``server.tracing``), when they are on."""
    batches: BatchRunner | None = None
    """The Batch API's store and runner (``server.batches``), when it is on."""
    draining: bool = False
    """Set on SIGTERM: /ready turns 503 and new generation requests are refused while in-flight ones finish."""

    def begin_drain(self) -> None:
        self.draining = True


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway

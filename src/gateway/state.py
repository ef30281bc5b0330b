"""What the routes share: config, backends, router, metrics. Built by ``create_app``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from backends.interface import Backend
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.router import ModelRouter


@dataclass
class GatewayState:
    config: GatewayConfig
    backends: dict[str, Backend]
    router: ModelRouter
    metrics: GatewayMetrics
    started_at: int = field(default_factory=lambda: int(time.time()))
    start_errors: dict[str, str] = field(default_factory=dict)


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway

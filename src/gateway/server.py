"""Runs the app under uvicorn with the settings and shutdown behaviour a serving gateway needs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from backends.heap import cap_mmap_threshold
from gateway.app import create_app
from gateway.config import GatewayConfig, ServerConfig
from gateway.connections import ConnectionGuard, ConnectionLimits
from gateway.logs import configure_logging


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, first marks the gateway as draining (``/ready`` 503, new requests refused), then lets
    uvicorn stop accepting and wait for in-flight requests up to ``server.drain_seconds`` before cancelling them
    (a cancelled stream aborts its engine request)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def run_server(settings: GatewayConfig) -> None:
    configure_logging(settings.server.log_level)
    # The engine thread and the event loop share the GIL. With the default 5 ms switch interval, every numpy or
    # C++ call that releases the GIL on the engine thread can wait up to 5 ms to get it back from a busy loop.
    sys.setswitchinterval(settings.server.gil_switch_interval)
    cap_mmap_threshold()  # multi-MiB bodies and prompts go back to the OS when freed (backends/heap.py)
    app = create_app(settings)
    config = uvicorn_config(settings, app, connection_guard(settings.server, app))
    DrainingServer(config, on_exit=app.state.gateway.begin_drain).run()


def connection_guard(server: ServerConfig, app: FastAPI) -> ConnectionGuard:
    """The connection limits of ``server``, counted in the app's metrics."""
    limits = ConnectionLimits(server.header_timeout, server.max_header_bytes, server.max_connections)
    return ConnectionGuard(limits, app.state.gateway.metrics.registry)


def uvicorn_config(settings: GatewayConfig, app: FastAPI, guard: ConnectionGuard) -> uvicorn.Config:
    """uvicorn as the gateway runs it: uvloop, httptools behind the connection limits of ``guard``."""
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        http=guard.protocol(),
        log_config=None,
        access_log=False,
        timeout_keep_alive=settings.server.keep_alive_timeout,
        timeout_graceful_shutdown=settings.server.drain_seconds,
    )

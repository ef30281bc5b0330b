"""Runs the app under uvicorn with the settings and shutdown behaviour a serving gateway needs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
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
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.server.drain_seconds,
    )
    DrainingServer(config, on_exit=app.state.gateway.begin_drain).run()

"""Admission control around a backend: at most ``max_in_flight`` requests, then a bounded, timed queue."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from backends.interface import Backend, Event, GenerateRequest
from gateway.limits import AdmissionGate


class AdmittedBackend:
    """Wraps a backend so every request holds a slot of its gate for as long as its events flow.

    Other attributes (name, kind, readiness, driver, ...) are the wrapped backend's, so routing, health and
    metrics see the backend itself.
    """

    def __init__(self, backend: Backend, gate: AdmissionGate) -> None:
        self.backend = backend
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        await self.gate.acquire()
        started = time.monotonic()
        try:
            # Closed here, not by the garbage collector: the backend's work is aborted before the slot is free.
            async with aclosing(self.backend.generate(request)) as events:
                async for event in events:
                    yield event
        finally:
            self.gate.release(time.monotonic() - started)


def admitted(backend: Backend, config: object) -> Backend:
    """The backend behind a gate if its config bounds in-flight requests (``max_in_flight``), else itself."""
    limit = getattr(config, "max_in_flight", None)
    if limit is None:
        return backend
    gate = AdmissionGate(backend.name, limit, getattr(config, "max_queue", 0), getattr(config, "queue_timeout", 30.0))
    return AdmittedBackend(backend, gate)  # type: ignore[return-value]

"""Admission control around a backend: at most ``max_in_flight`` requests, then flow control's tiered, fair,
bounded and timed queues (``gateway.flow_control``), whatever the backend's kind (in process, data-parallel ranks
behind their dispatcher, LMDeploy nodes): the gateway holds the queue, the backend sees only admitted requests."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from backends.config import AdmissionConfig
from backends.interface import (
    NOT_OPENED,
    Backend,
    CallTrace,
    Event,
    EventStream,
    GenerateRequest,
    TraceValue,
    batches_of,
    never_notifies,
    notify_of,
    traced_stage,
)
from gateway.capabilities import WrappedBackend
from gateway.flow_control import Admission, FlowController, FlowMetrics, tier_bounds


class AdmittedBackend(WrappedBackend):
    """Wraps a backend so every request holds a slot of its gate for as long as its events flow; its optional
    capabilities (tokenizer, statistics, ...) are ``inner``'s (``gateway.capabilities``)."""

    __slots__ = ("gate",)

    def __init__(self, backend: Backend, gate: FlowController) -> None:
        super().__init__(backend)
        self.gate = gate

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        return _AdmittedEvents(self.inner, self.gate, request)


class _AdmittedEvents:
    """A backend's events holding a slot of the gate: the first step waits for the slot and opens the backend's
    stream; every later step, one event or a batch, is the backend's own (no wrapper per event). The slot is freed
    by ``aclose``, after the backend's stream was closed (its work aborted): the consumer closes the stream when it
    ends, whichever way (``RoutedStream`` and ``interleave`` do)."""

    __slots__ = ("_backend", "_closed", "_events", "_gate", "_request", "_started", "notify", "ready", "wait")

    def __init__(self, backend: Backend, gate: FlowController, request: GenerateRequest) -> None:
        self._backend = backend
        self._gate = gate
        self._request = request
        self._events: EventStream[Event] | None = None
        # ``BatchStream``: the backend's stream's own methods once it gave its first event (no call of ours per batch)
        self.ready: Callable[[], list[Event]] = NOT_OPENED.ready
        self.wait: Callable[[], Awaitable[None]] = NOT_OPENED.wait
        self.notify: Callable[[Callable[[], None]], bool] = never_notifies
        self._started: float | None = None  # when the slot was taken
        self._closed = False

    def __aiter__(self) -> _AdmittedEvents:
        return self

    def __anext__(self) -> Awaitable[Event]:
        events = self._events
        return self._first() if events is None else events.__anext__()

    async def _first(self) -> Event:
        if self._closed:
            raise StopAsyncIteration
        request = self._request
        admission = self._gate.admission_of(request)
        try:
            if request.trace is None:
                await self._gate.acquire(request, admission)
            else:
                await _acquire_traced(self._gate, request, admission, request.trace)
        finally:
            if request.log is not None:
                request.log.update(admission.log_fields())
        self._started = time.monotonic()
        events = self._events = self._backend.generate(self._request)
        event = await events.__anext__()
        batches = batches_of(events)  # taken after the first event: the stream's own batches exist from then on
        self.ready, self.wait, self.notify = batches.ready, batches.wait, notify_of(batches)
        return event

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        started = self._started
        if started is None:
            return  # never held a slot
        try:
            if self._events is not None:
                await self._events.aclose()
        finally:
            self._gate.release(time.monotonic() - started)


async def _acquire_traced(
    gate: FlowController, request: GenerateRequest, admission: Admission, trace: CallTrace
) -> None:
    """``gate.acquire()``, recorded in the call's trace as ``gateway.admission`` (its length: the queue wait), with
    the numbers of the request's log line."""
    attributes: dict[str, TraceValue] = {
        "gateway.admission.in_flight": gate.in_flight,  # at arrival
        "gateway.admission.queued": gate.queued,
    }
    with traced_stage(trace, "gateway.admission", attributes) as started:
        try:
            await gate.acquire(request, admission)
        finally:
            attributes["gen_ai.latency.time_in_queue"] = (time.time_ns() - started) / 1e9
            for name, value in admission.log_fields().items():
                attributes[f"gateway.admission.{name}"] = value


def behind_flow_control(
    backend: Backend,
    config: AdmissionConfig,
    *,
    weights: Mapping[str, float] | None = None,
    metrics: FlowMetrics | None = None,
) -> Backend:
    """The backend behind flow control if its config bounds in-flight requests (``max_in_flight``), else itself.
    ``weights``: the API keys' shares by label (``api_keys[].weight``)."""
    limit = config.max_in_flight
    if limit is None:
        return backend
    gate = FlowController(
        backend.name,
        limit,
        tier_bounds(config),
        fair=config.flow_control == "fair",
        weights=weights,
        metrics=metrics,
    )
    return AdmittedBackend(backend, gate)

"""OpenTelemetry traces: one trace per request, joined to the caller's W3C trace context, exported over OTLP/HTTP.

A request's spans (never one per token):

- the server span (``gateway.middleware.TracingMiddleware``), kind SERVER, ``POST /v1/chat/completions``: HTTP
  method, route and status, ``gateway.request_id`` (the ``X-Request-ID``), the model, the backend that served it,
  the API key's name (never the key), token counts, time to first token, ``error.type``;
- ``gateway.route`` (``ModelRouter.route``): the target chosen, how (``gateway.route.via``: the policy,
  ``pinned``), and the shadow backend when the request was mirrored;
- one span per backend call (``RoutedStream``, ``ShadowMirror``), kind CLIENT, named ``{operation} {model}`` as the
  GenAI conventions have it: the first target, each fallback (``gateway.route.via: fallback``; the call it
  replaced names it in ``gateway.route.fallback``), the shadow (``via: shadow``). It records the time to first
  token (an event and ``gen_ai.latency.time_to_first_token``) and summarises decoding in attributes: tokens,
  ``gen_ai.latency.time_per_output_token``, finish reasons, and what the backend reported through
  ``CallTrace``: the data-parallel rank, the LMDeploy node;
- under the call, the stages the backend reported: ``gateway.admission`` (the wait for a slot of the backend's
  gate) and ``engine.prepare_prompt`` (its attributes split it into the wait for a pool thread, rendering,
  tokenizing and compiling the grammar), measured where they ran and reported afterwards.

Attribute names are the GenAI and HTTP semantic conventions' where they exist (``gen_ai.request.model``,
``gen_ai.usage.input_tokens``, ``http.response.status_code``...); latencies, which the conventions have only as
metrics, are named as vLLM names them (``gen_ai.latency.*``, seconds), so queries carry over; the rest is
``gateway.*``.

Spans go to a ``BatchSpanProcessor``: ending a span appends it to a bounded queue (a full queue drops spans, which
the SDK logs, rather than wait); encoding and posting happen on the processor's own thread, never on the event
loop or an engine thread. Each app has its own ``TracerProvider`` (several apps share a test process; the global
provider is never set), and each front-end process of ``server.runtime.workers`` its own exporter, told apart by
``service.instance.id``. The app's lifespan flushes and shuts the exporter down after the drain.

Imported only when ``server.tracing`` is active (the ``tracing`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope

from backends.errors import BackendError
from backends.interface import (
    Backend,
    Delta,
    Event,
    EventStream,
    Finish,
    GenerateRequest,
    TraceStage,
    TraceValue,
    Usage,
)
from gateway import __version__
from gateway.capabilities import WrappedBackend
from gateway.tracing_config import TracingConfig

logger = logging.getLogger(__name__)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})


class Tracing:
    """The app's tracer provider, exporter and propagator, and the spans of its requests."""

    def __init__(self, config: TracingConfig, *, exporter: SpanExporter | None = None) -> None:
        self.config = config
        resource = Resource.create(
            {
                **config.resource_attributes,
                "service.name": config.service_name,
                "service.version": __version__,
                "service.instance.id": str(uuid.uuid4()),  # one per front-end process
                "process.pid": os.getpid(),
            }
        )
        self.exporter = exporter or OTLPSpanExporter(
            endpoint=config.traces_url(),
            headers=config.headers,
            timeout=config.timeout,
            compression=Compression(config.compression),
        )
        self.provider = TracerProvider(
            sampler=_sampler(config.sampler, config.sampler_arg), resource=resource, shutdown_on_exit=False
        )
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("deepinfer-gateway", __version__)
        self.propagator = TraceContextTextMapPropagator()

    # ---- the server span ------------------------------------------------------------------------------------

    def start_request(self, scope: Scope, request_id: str) -> RequestSpan | None:
        """The request's server span, a child of the caller's span when it sent ``traceparent``; it is the current
        span until ``RequestSpan.end``, so the request's other spans descend from it. Probes and scrapes
        (``UNTRACED_PATHS``) get none: they would bury the requests' traces."""
        if scope["path"] in UNTRACED_PATHS:
            return None
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name in _TRACE_HEADERS:
                carrier[name.decode()] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        method = scope["method"]
        attributes: dict[str, TraceValue] = {
            "http.request.method": method,
            "url.path": scope["path"],
            "gateway.request_id": request_id,
        }
        client = scope.get("client")
        if client:
            attributes["client.address"] = client[0]
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return RequestSpan(span, otel_context.attach(set_span_in_context(span, parent)))

    # ---- routing and backend calls ----------------------------------------------------------------------------

    def record_route(self, started_ns: int, model: str, target: str, via: str, shadow: str | None) -> None:
        """The routing decision for the current request (``started_ns``: when it began)."""
        if not get_current_span().is_recording():
            return
        attributes: dict[str, TraceValue] = {
            "gen_ai.request.model": model,
            "gateway.route.target": target,
            "gateway.route.via": via,
        }
        if shadow is not None:
            attributes["gateway.route.shadow"] = shadow
        self.tracer.start_span("gateway.route", start_time=started_ns, attributes=attributes).end()

    def backend_call(self, backend: Backend, request: GenerateRequest | None, via: str) -> BackendCall | None:
        """A span for one call of ``backend`` for the current request; None when the request is not traced."""
        if not get_current_span().is_recording():
            return None
        model = request.model if request is not None else ""
        operation = "chat" if request is None or request.kind == "chat" else "text_completion"
        attributes: dict[str, TraceValue] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": backend.kind,
            "gen_ai.request.model": model,
            "gateway.backend": backend.name,
            "gateway.route.via": via,
        }
        if request is not None:
            _request_attributes(attributes, request)
        span = self.tracer.start_span(f"{operation} {model}", kind=SpanKind.CLIENT, attributes=attributes)
        return BackendCall(self, span, backend)

    # ---- life cycle --------------------------------------------------------------------------------------------

    def flush(self, timeout_millis: int = 30_000) -> bool:
        """Exports every ended span now (blocking: for tests and tools, not the event loop)."""
        return self.provider.force_flush(timeout_millis)

    async def aclose(self) -> None:
        """Exports what is left and stops the exporter, on a thread, waiting at most the export timeout (a
        collector that is down must not hold the shutdown up)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shut_down() -> None:
            try:
                self.provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits any more
                    loop.call_soon_threadsafe(_settle, done)

        threading.Thread(target=shut_down, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), self.config.timeout + 1.0)
        except TimeoutError:
            logger.warning("traces not exported within %.0f s of shutdown; the rest are dropped", self.config.timeout)


class RequestSpan:
    """One HTTP request's server span, current while the request runs."""

    __slots__ = ("_token", "span")

    def __init__(self, span: Span, token: object) -> None:
        self.span = span
        self._token = token

    @property
    def trace_id(self) -> str | None:
        """The trace's id (hex), for the access log line; None when the request is not sampled."""
        if not self.span.is_recording():
            return None
        return format(self.span.get_span_context().trace_id, "032x")

    def end(self, status: int, log: Mapping[str, Any], api_key: str | None, route: str | None) -> None:
        """Ends the span with what the request's log line says of it (model, backend, tokens, error code)."""
        otel_context.detach(self._token)  # type: ignore[arg-type]
        span = self.span
        if span.is_recording():
            attributes: dict[str, TraceValue] = {"http.response.status_code": status}
            if route is not None:
                attributes["http.route"] = route
                span.update_name(f"{span.name} {route}")  # type: ignore[attr-defined]
            for key, name in _LOG_ATTRIBUTES:
                value = log.get(key)
                if value is not None and value != "":
                    attributes[name] = value
            ttft_ms = log.get("ttft_ms")
            if ttft_ms is not None:
                attributes["gen_ai.latency.time_to_first_token"] = ttft_ms / 1000
            if api_key is not None:
                attributes["gateway.api_key.name"] = api_key
            if status >= 400:
                attributes["error.type"] = log.get("error_code") or str(status)
            span.set_attributes(attributes)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.end()


_LOG_ATTRIBUTES = (
    ("model", "gen_ai.request.model"),
    ("backend", "gateway.backend"),
    ("prompt_tokens", "gen_ai.usage.input_tokens"),
    ("completion_tokens", "gen_ai.usage.output_tokens"),
)


class BackendCall:
    """One call of a backend for a request: its span, fed by the routed stream, and the ``CallTrace`` the call's
    requests carry to the backend (``backend`` is the backend as this call sees it)."""

    __slots__ = ("_ended", "_finishes", "_first_ns", "_span", "_started_ns", "_tracing", "_usage", "backend")

    def __init__(self, tracing: Tracing, span: Span, backend: Backend) -> None:
        self._tracing = tracing
        self._span = span
        self._started_ns = time.time_ns()
        self._first_ns: int | None = None
        self._finishes: list[str] = []
        self._usage: Usage | None = None
        self._ended = False
        self.backend: Backend = _TracedBackend(backend, self)

    # ---- CallTrace: what the backend reports ----------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=set_span_in_context(self._span))
        return carrier

    def record(self, stage: TraceStage) -> None:
        span = self._tracing.tracer.start_span(
            stage.name, context=set_span_in_context(self._span), start_time=stage.start_ns, attributes=stage.attributes
        )
        if stage.error is not None:
            span.set_status(Status(StatusCode.ERROR, stage.error))
        span.end(end_time=stage.end_ns)

    def annotate(self, name: str, value: TraceValue) -> None:
        self._span.set_attribute(name, value)

    # ---- the routed stream's side ---------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """Called with each of the call's events: the first token, finish reasons and usage (no per-token span)."""
        kind = type(event)
        if kind is Delta:
            if self._first_ns is None:
                self._first_ns = time.time_ns()
                self._span.add_event("gen_ai.first_token", timestamp=self._first_ns)
        elif kind is Finish:
            self._finishes.append(event.reason)  # type: ignore[union-attr]
        elif kind is Usage:
            self._usage = event  # type: ignore[assignment]

    def end(self, exc: BaseException | None, fallback: str | None = None) -> None:
        """Ends the call: ``exc`` is how it failed (None: it completed), ``fallback`` the target that takes over."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        now = time.time_ns()
        attributes: dict[str, TraceValue | Sequence[str]] = {}
        output_tokens = 0
        if self._usage is not None:
            output_tokens = self._usage.completion_tokens
            attributes["gen_ai.usage.input_tokens"] = self._usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        if self._finishes:
            attributes["gen_ai.response.finish_reasons"] = tuple(self._finishes)
        if self._first_ns is not None:
            attributes["gen_ai.latency.time_to_first_token"] = (self._first_ns - self._started_ns) / 1e9
            if output_tokens > 1:
                attributes["gen_ai.latency.time_per_output_token"] = (now - self._first_ns) / 1e9 / (output_tokens - 1)
        if fallback is not None:
            attributes["gateway.route.fallback"] = fallback
        if isinstance(exc, BackendError):
            attributes["error.type"] = exc.code or type(exc).__name__
            span.set_status(Status(StatusCode.ERROR, exc.message))
        elif isinstance(exc, GeneratorExit | asyncio.CancelledError):
            attributes["gateway.call.cancelled"] = True  # the client left, a deadline passed, or a stop string
        elif exc is not None:
            attributes["error.type"] = type(exc).__name__
            span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.set_attributes(attributes)
        span.end(end_time=now)


class _TracedBackend(WrappedBackend):
    """A backend as one traced call sees it: the requests it is asked to generate carry the call's trace; its
    optional capabilities are ``inner``'s (``gateway.capabilities``)."""

    __slots__ = ("_call",)

    def __init__(self, backend: Backend, call: BackendCall) -> None:
        super().__init__(backend)
        self._call = call

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        return self.inner.generate(dataclasses.replace(request, trace=self._call))


def _request_attributes(attributes: dict[str, TraceValue], request: GenerateRequest) -> None:
    sampling = request.sampling
    for name, value in (
        ("gen_ai.request.max_tokens", sampling.max_tokens),
        ("gen_ai.request.temperature", sampling.temperature),
        ("gen_ai.request.top_p", sampling.top_p),
        ("gen_ai.request.top_k", sampling.top_k),
        ("gen_ai.request.seed", sampling.seed),
    ):
        if value is not None:
            attributes[name] = value
    if request.n != 1:
        attributes["gen_ai.request.choice.count"] = request.n


def _sampler(name: str, ratio: float) -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER`` names (``parentbased_*``: the caller's sampled flag decides when it sent
    one, the root sampler otherwise)."""
    base = name.removeprefix("parentbased_")
    root = TraceIdRatioBased(ratio) if base == "traceidratio" else ALWAYS_ON if base == "always_on" else ALWAYS_OFF
    return ParentBased(root) if base != name else root


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)

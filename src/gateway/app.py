"""``create_app(config)``: the FastAPI application and its lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp

from backends.interface import Backend
from backends.registry import BackendKindUnavailableError, build_backend
from gateway import __version__
from gateway.admission import behind_flow_control
from gateway.anthropic.signatures import signer_for
from gateway.auth import ApiKeyMiddleware, key_label
from gateway.batches import routes as batches
from gateway.batches.runner import BatchRunner
from gateway.batches.store import open_batch_store
from gateway.bodies import JSONBodyParser
from gateway.config import GatewayConfig
from gateway.endpoints import admin, generate, messages, models, operations, tokenize
from gateway.errors import install_error_handlers
from gateway.flow_control import FlowMetrics, KeyTiers
from gateway.gateway_state import GatewayState
from gateway.limits import KeyLimits
from gateway.metrics import GatewayMetrics
from gateway.middleware import (
    AccessLogMiddleware,
    BodyLimitMiddleware,
    DrainMiddleware,
    IncompleteBodyMiddleware,
    InternalErrorMiddleware,
    RequestIdMiddleware,
    RequestMetricsMiddleware,
    TracingMiddleware,
    WithoutDirectBody,
    body_rewriters,
)
from gateway.responses import route as responses
from gateway.responses.store import StoredResponses, open_response_store
from gateway.routing.model_router import ModelRouter
from gateway.shared_store import SharedStateStore
from gateway.tracing_config import TracingConfig

if TYPE_CHECKING:
    from backends.interface import Event, EventStream, GenerateRequest
    from gateway.tracing import Tracing

logger = logging.getLogger(__name__)
GC_GEN0_THRESHOLD = 25_000
"""Against 10,000, on two DP ranks with 256 streams: 4-7% less front-end CPU per streamed token, and the longest
young-generation pause 6.5 ms instead of 17 ms (docs/bench.md, "Garbage, spinning threads and one write less")."""


def create_app(
    config: GatewayConfig,
    backends: Mapping[str, Backend] | None = None,
    *,
    serve_once_started: bool = False,
    budget_clock: Callable[[], float] | None = None,
    batch_clock: Callable[[], float] = time.time,
) -> FastAPI:
    """Builds the app. Backends start in the background so ``/health`` answers at once and ``/ready`` tells
    when they are up (a DeepInfer engine can take minutes). With ``serve_once_started`` (one of several front-end
    processes on a shared socket) the app takes no connection before its backends have started, so a process
    that is still starting never takes requests its siblings could serve. ``budget_clock`` is the clock per-key
    budgets refill by, here and in the shared store (tests freeze it); by default this process's monotonic clock,
    and the store's own clock for shared budgets. ``batch_clock`` is the wall clock of the Batch API (creation and
    expiry times, file retention)."""
    start_errors: dict[str, str] = {}
    metrics = GatewayMetrics()
    server = config.server
    key_tiers = KeyTiers([(key_label(key, i), key) for i, key in enumerate(server.auth.client_keys())])
    if backends is None:
        backends = _built_backends(config, key_tiers, metrics, start_errors)
    metrics.watch_backends(backends.values())
    store = SharedStateStore(server.stores.state_store, clock=time.monotonic) if server.stores.state_store else None
    if store is not None:
        metrics.watch_state_store(store)
    tracing = start_tracing(server.tracing)
    key_limits = KeyLimits(
        server, store=store, processes=server.runtime.workers, registry=metrics.registry, clock=budget_clock
    )
    stored_responses = _stored_responses(config, store, metrics)
    batch_runner = _batch_runner(config, store, metrics, batch_clock)
    state = GatewayState(
        config=config,
        backends=dict(backends),
        router=ModelRouter(config.models, backends, metrics.registry, tracing=tracing),
        metrics=metrics,
        start_errors=start_errors,
        limits=key_limits,
        key_tiers=key_tiers,
        store=store,
        responses=stored_responses,
        thinking_signer=signer_for(server.auth.thinking_signature_key),
        tracing=tracing,
        batches=batch_runner,
    )
    json_parser = JSONBodyParser(config.server.http.json_parse_processes)
    lifespan = _lifespan(state, key_limits, stored_responses, json_parser, serve_once_started=serve_once_started)
    return _gateway_app(state, lifespan, json_parser)


def _gateway_app(
    state: GatewayState, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]], json_parser: JSONBodyParser
) -> FastAPI:
    """The FastAPI app over ``state``: middleware, error handlers and every route group."""
    # No redirects for a trailing slash: Starlette's would build its Location from the client's Host header, and
    # an SDK does not follow a redirect of a POST; ``/metrics/`` is a 404 like any other unknown URL.
    app = GatewayApp(
        title="deepinfer-gateway",
        version=__version__,
        lifespan=lifespan,
        redirect_slashes=False,
        middleware=gateway_middleware(state),
    )
    app.state.gateway = state
    app.state.json_parser = json_parser  # read by the generation routes' OffloadedJSONRoute
    install_error_handlers(app)
    for routes in (generate, responses, messages, models, tokenize, operations, admin, batches):
        app.include_router(routes.router)
    return app


def _built_backends(
    config: GatewayConfig, key_tiers: KeyTiers, metrics: GatewayMetrics, start_errors: dict[str, str]
) -> dict[str, Backend]:
    """Every configured backend behind its admission gate; one whose kind cannot run here stands in as unavailable
    (``start_errors`` says why, and ``/ready``)."""
    built: dict[str, Backend] = {}
    flow_metrics = FlowMetrics(metrics.registry)
    for backend_config in config.backends:
        try:
            backend = build_backend(backend_config)
            built[backend_config.name] = behind_flow_control(
                backend, backend_config, weights=key_tiers.weights, metrics=flow_metrics
            )
        except BackendKindUnavailableError as exc:
            start_errors[backend_config.name] = str(exc)
            built[backend_config.name] = _UnavailableBackend(backend_config.name, backend_config.kind, str(exc))
    return built


def _stored_responses(
    config: GatewayConfig, store: SharedStateStore | None, metrics: GatewayMetrics
) -> StoredResponses:
    server = config.server
    return StoredResponses(
        open_response_store(
            server.stores.responses_store,
            max_age=server.stores.responses_max_age,
            max_bytes=server.stores.responses_max_bytes,
            shared=store.client if store is not None else None,
        ),
        metrics.registry,
    )


def _batch_runner(
    config: GatewayConfig, store: SharedStateStore | None, metrics: GatewayMetrics, clock: Callable[[], float]
) -> BatchRunner | None:
    batch_config = config.server.batches
    if not batch_config.enabled:
        return None
    return BatchRunner(
        open_batch_store(batch_config, store.client if store is not None else None),
        batch_config,
        model_exists=lambda name: _serves(config, name),
        registry=metrics.registry,
        clock=clock,
    )


def _lifespan(
    state: GatewayState,
    key_limits: KeyLimits,
    stored_responses: StoredResponses,
    json_parser: JSONBodyParser,
    *,
    serve_once_started: bool,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Starts the backends (in the background unless ``serve_once_started``), the shared store's watch and the
    batch runner; stops all of it, in an order that lets work under way settle."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.metrics.watch_gc()
        starting = asyncio.create_task(_start_backends(state))
        if serve_once_started:
            await asyncio.shield(starting)
        if state.config.server.runtime.gc_tuning:
            starting.add_done_callback(_freeze_gc)
        store, batch_runner = state.store, state.batches
        watching = asyncio.create_task(store.watch()) if store is not None else None
        batching = asyncio.create_task(batch_runner.serve(app)) if batch_runner is not None else None
        try:
            yield
        finally:
            if batching is not None and batch_runner is not None:
                batching.cancel()  # its requests in flight are aborted and its leases given back
                await asyncio.gather(batching, return_exceptions=True)
                await batch_runner.store.close()
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await key_limits.aclose()  # settlements under way reach the store
            if watching is not None and store is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
                await store.close()
            await state.router.aclose()  # shadow requests: cancelled, they never hold the shutdown up
            await asyncio.gather(*(b.stop() for b in state.backends.values()), return_exceptions=True)
            json_parser.close()
            await stored_responses.aclose()
            state.metrics.close()
            if state.tracing is not None:
                await state.tracing.aclose()  # after the drain and the shadows: every request's spans have ended

    return lifespan


def gateway_middleware(state: GatewayState) -> list[Middleware]:
    """The gateway's ASGI middleware, outermost first (``gateway.middleware`` says what each one does and why)."""
    server = state.config.server
    stack = [Middleware(RequestIdMiddleware)]
    if server.runtime.access_log:
        stack.append(Middleware(AccessLogMiddleware))
    if state.tracing is not None:
        stack.append(Middleware(TracingMiddleware, tracing=state.tracing))
    larger_bodies = {batches.UPLOAD_PATH: server.batches.max_file_bytes + batches.MULTIPART_OVERHEAD}
    return [
        *stack,
        Middleware(RequestMetricsMiddleware, metrics=state.metrics),
        Middleware(IncompleteBodyMiddleware),
        Middleware(DrainMiddleware, draining=lambda: state.draining),
        Middleware(BodyLimitMiddleware, max_body_bytes=server.http.max_body_bytes, larger_bodies=larger_bodies),
        Middleware(InternalErrorMiddleware),
        Middleware(
            ApiKeyMiddleware,
            client_keys=server.auth.client_keys(),
            admin_key=server.auth.admin_api_key,
            public_metrics=server.auth.public_metrics,
        ),
    ]


class GatewayApp(FastAPI):
    """The gateway's FastAPI app. A middleware a user adds (``app.add_middleware``) that is not known to pass
    response bodies through unchanged, Starlette's GZip say, turns direct body writes off when the middleware stack
    is built, so that it sees every body frame of every response."""

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        rewriters = body_rewriters(self.user_middleware)
        if not rewriters:
            return stack
        logger.info("direct body writes off: %s may rewrite response bodies", ", ".join(rewriters))
        return WithoutDirectBody(stack)


def _serves(config: GatewayConfig, name: str) -> bool:
    """Whether a model (or an alias of one) of that name is served: a batch line naming another fails validation."""
    return any(name == model.name or name in model.aliases for model in config.models)


def start_tracing(config: TracingConfig) -> Tracing | None:
    """The app's tracing when ``server.tracing`` is active; otherwise None, and OpenTelemetry is not even imported."""
    if not config.active:
        return None
    problem = config.unavailable()
    if problem is not None:
        raise RuntimeError(problem)
    from gateway.tracing import Tracing

    tracing = Tracing(config)
    logger.info("tracing on: spans go to %s (sampler %s)", config.traces_url(), config.sampler)
    return tracing


def _freeze_gc(_: object) -> None:
    """Objects alive after start-up (modules, tokenizer tables, engine state) live as long as the process:
    move them out of the collector's sight and collect the young generation less often, since a serving loop
    allocates many short-lived objects and full collections over a large heap stall every stream."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)


async def _start_backends(state: GatewayState) -> None:
    async def start(name: str, backend: Backend) -> None:
        if name in state.start_errors:
            return
        try:
            await backend.start()
        except Exception as exc:
            logger.exception("backend %s failed to start", name)
            state.start_errors[name] = f"start failed: {exc}"
        else:
            logger.info("backend %s ready", name)

    await asyncio.gather(*(start(name, b) for name, b in state.backends.items()))
    state.started = True


class _UnavailableBackend:
    """Stands in for a configured backend that cannot run here, so readiness can say why."""

    def __init__(self, name: str, kind: str, reason: str) -> None:
        self.name = name
        self.kind = kind
        self._reason = reason

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def readiness(self) -> tuple[bool, str]:
        return False, self._reason

    def max_model_len(self) -> int | None:
        return None

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        from backends.errors import UnavailableError

        raise UnavailableError(self._reason)

"""``create_app(config)``: the FastAPI application and its lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from backends.interface import Backend
from backends.registry import BackendKindUnavailableError, build_backend
from gateway import __version__
from gateway.admission import admitted
from gateway.anthropic.signatures import signer_for
from gateway.auth import ApiKeyMiddleware, key_label
from gateway.batches import routes as batches
from gateway.batches.runner import BatchRunner
from gateway.batches.store import open_batch_store
from gateway.bodies import JSONBodyParser
from gateway.config import GatewayConfig
from gateway.errors import install_error_handlers
from gateway.flow_control import FlowMetrics, KeyTiers
from gateway.limits import KeyLimits
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestContextMiddleware
from gateway.responses import route as responses
from gateway.responses.store import StoredResponses, open_response_store
from gateway.router import ModelRouter
from gateway.routes import admin, generate, messages, models, operations, tokenize
from gateway.state import GatewayState
from gateway.state_store import SharedStateStore
from gateway.tracing_config import TracingConfig

if TYPE_CHECKING:
    from backends.interface import Event, EventStream, GenerateRequest
    from gateway.tracing import Tracing

logger = logging.getLogger(__name__)
GC_GEN0_THRESHOLD = 10_000


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
        built: dict[str, Backend] = {}
        flow_metrics = FlowMetrics(metrics.registry)
        for backend_config in config.backends:
            try:
                backend = build_backend(backend_config)
                built[backend_config.name] = admitted(
                    backend, backend_config, weights=key_tiers.weights, metrics=flow_metrics
                )
            except BackendKindUnavailableError as exc:
                start_errors[backend_config.name] = str(exc)
                built[backend_config.name] = _UnavailableBackend(backend_config.name, backend_config.kind, str(exc))
        backends = built
    metrics.watch_backends(backends.values())
    store = SharedStateStore(server.stores.state_store, clock=time.monotonic) if server.stores.state_store else None
    if store is not None:
        metrics.watch_state_store(store)
    tracing = start_tracing(server.tracing)
    key_limits = KeyLimits(
        server, store=store, processes=server.runtime.workers, registry=metrics.registry, clock=budget_clock
    )
    stored_responses = StoredResponses(
        open_response_store(
            server.stores.responses_store,
            max_age=server.stores.responses_max_age,
            max_bytes=server.stores.responses_max_bytes,
            shared=store.client if store is not None else None,
        ),
        metrics.registry,
    )
    batch_config = server.batches
    batch_runner = (
        BatchRunner(
            open_batch_store(batch_config, store.client if store is not None else None),
            batch_config,
            model_exists=lambda name: _serves(config, name),
            registry=metrics.registry,
            clock=batch_clock,
        )
        if batch_config.enabled
        else None
    )
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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.watch_gc()
        starting = asyncio.create_task(_start_backends(state))
        if serve_once_started:
            await asyncio.shield(starting)
        if config.server.runtime.gc_tuning:
            starting.add_done_callback(_freeze_gc)
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
            metrics.close()
            if tracing is not None:
                await tracing.aclose()  # after the drain and the shadows: every request's spans have ended

    # No redirects for a trailing slash: Starlette's would build its Location from the client's Host header, and
    # an SDK does not follow a redirect of a POST; ``/metrics/`` is a 404 like any other unknown URL.
    app = FastAPI(title="deepinfer-gateway", version=__version__, lifespan=lifespan, redirect_slashes=False)
    app.state.gateway = state
    app.state.json_parser = json_parser  # read by the generation routes' OffloadedJSONRoute
    install_error_handlers(app)
    app.include_router(generate.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(models.router)
    app.include_router(tokenize.router)
    app.include_router(operations.router)
    app.include_router(admin.router)
    app.include_router(batches.router)
    app.add_middleware(
        ApiKeyMiddleware,
        client_keys=config.server.auth.client_keys(),
        admin_key=config.server.auth.admin_api_key,
        public_metrics=config.server.auth.public_metrics,
    )
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=config.server.http.max_body_bytes,
        access_log=config.server.runtime.access_log,
        draining=lambda: state.draining,
        metrics=metrics,
        tracing=tracing,
        larger_bodies={batches.UPLOAD_PATH: batch_config.max_file_bytes + batches.MULTIPART_OVERHEAD},
    )
    return app


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

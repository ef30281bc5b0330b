"""Maps a public model name to the target that serves a request: policy, pinning, fallbacks, shadow.

The request flow stays front -> router -> backend: a route handler asks ``ModelRouter.route`` for the
request's events and streams them; the router picks a target with the model's policy and returns a
``RoutedStream`` that falls back before the first event and accounts for the request when it ends. The
pieces live beside it in ``gateway.routing``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from backends.errors import UnavailableError
from backends.interface import Backend, GenerateRequest
from gateway.config import ModelConfig
from gateway.errors import APIError, model_not_found
from gateway.routing.breaker import CircuitBreaker
from gateway.routing.policies import PrefixAffinityPolicy, build_policy
from gateway.routing.shadow import ShadowMirror
from gateway.routing.stream import EventFactory, RoutedStream
from gateway.routing.targets import BackendLoad, Target
from gateway.routing.telemetry import RoutingMetrics

if TYPE_CHECKING:
    from gateway.tracing import Tracing

PIN_HEADER = "x-backend"
SESSION_HEADER = "x-session-id"


class ModelRoutes:
    """One served model: its targets (policy candidates and fallbacks), policy, pinning and shadow."""

    def __init__(
        self,
        config: ModelConfig,
        backends: Mapping[str, Backend],
        loads: Mapping[str, BackendLoad],
        metrics: RoutingMetrics,
        rng: random.Random | None,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = config.name
        self.metrics = metrics
        self.tracing = tracing
        self.allow_pin = config.allow_pin_header
        breaker = config.circuit_breaker
        self.targets: dict[str, Target] = {}

        def target(name: str) -> Target:
            existing = self.targets.get(name)
            if existing is None:
                existing = self.targets[name] = Target(
                    config.name,
                    backends[name],
                    weight=0.0,
                    load=loads[name],
                    breaker=CircuitBreaker(breaker.failure_threshold, breaker.cooldown_seconds),
                    primary=False,
                )
            return existing

        for entry in config.targets():
            t = target(entry.backend)
            t.primary, t.weight = True, entry.weight
        for name in config.fallbacks:
            target(name).fallback = True
        self.candidates = tuple(t for t in self.targets.values() if t.primary and t.weight > 0)
        self.fallbacks = tuple(self.targets[name] for name in config.fallbacks)
        self.policy = build_policy(
            config.policy,
            prefix_chars=config.affinity.prefix_chars,
            load_factor=config.affinity.load_factor,
            load_slack=config.affinity.load_slack,
            rng=rng,
        )
        self._wants_session = isinstance(self.policy, PrefixAffinityPolicy)
        self.shadow: ShadowMirror | None = None
        if config.shadow is not None:
            self.shadow = ShadowMirror(
                config.name,
                backends[config.shadow.backend],
                loads[config.shadow.backend],
                fraction=config.shadow.fraction,
                max_concurrency=config.shadow.max_concurrency,
                metrics=metrics,
                rng=rng,
                tracing=tracing,
            )

    def choose(self, request: GenerateRequest | None, headers: Mapping[str, str] | None) -> tuple[Target, str]:
        """The target to try first and how it was chosen (the policy's name, ``pinned`` or ``fallback``)."""
        if self.allow_pin and headers is not None:
            pin = headers.get(PIN_HEADER)
            if pin:
                return self._pinned(pin), "pinned"
        available = [t for t in self.candidates if t.available()]
        if available:
            session = headers.get(SESSION_HEADER) if self._wants_session and headers is not None else None
            return self.policy.pick(available, request, session), self.policy.name
        for target in self.fallbacks:
            if target.available():
                return target, "fallback"
        reasons = "; ".join(f"{t.name}: {t.unavailable_reason()}" for t in self.targets.values())
        raise UnavailableError(f"no backend of model '{self.name}' is available ({reasons})", retry_after=5)

    def _pinned(self, name: str) -> Target:
        target = self.targets.get(name)
        if target is None:
            raise APIError(
                400,
                f"X-Backend: backend '{name}' does not serve model '{self.name}' "
                f"(its backends: {', '.join(self.targets)}).",
                param="X-Backend",
                code="invalid_backend",
            )
        if not target.available():
            raise UnavailableError(
                f"X-Backend: backend '{name}' is not available ({target.unavailable_reason()})", retry_after=5
            )
        return target

    def ready_targets(self) -> list[Target]:
        """The targets an unpinned request may be sent to by their backends' health, in the order ``choose``
        tries them (policy candidates, then fallbacks). Circuits are left out: an open circuit is a passive,
        per-process cut-off that reroutes or retries after its cool-down, not a verdict on the pod."""
        ready = [t for t in self.candidates if t.backend.readiness()[0]]
        return ready + [t for t in self.fallbacks if t not in ready and t.backend.readiness()[0]]

    def next_fallback(self, tried: list[Target]) -> Target | None:
        for target in self.fallbacks:
            if target not in tried and target.available():
                return target
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "allow_pin_header": self.allow_pin,
            "fallbacks": [t.name for t in self.fallbacks],
            "targets": [t.describe() for t in self.targets.values()],
            "shadow": self.shadow.describe() if self.shadow is not None else None,
        }


class ModelRouter:
    """Every served model's routes, and the per-backend load they share."""

    def __init__(
        self,
        models: list[ModelConfig],
        backends: Mapping[str, Backend],
        registry: CollectorRegistry | None = None,
        *,
        rng: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.metrics = RoutingMetrics(registry)
        self.tracing = tracing
        loads = {name: BackendLoad() for name in backends}
        self._models = {m.name: ModelRoutes(m, backends, loads, self.metrics, rng, tracing) for m in models}
        self.model_names = list(self._models)
        self.aliases = {alias: m.name for m in models for alias in m.aliases}
        """Every alias and the served model name it stands for (``models[].aliases``)."""
        self.metrics.watch(self.targets, self.shadows)

    def route(
        self,
        model: str,
        request: GenerateRequest | None,
        headers: Mapping[str, str] | None,
        factory: EventFactory,
    ) -> RoutedStream:
        """The events of ``request`` from the target the model's policy picks (``factory`` opens them on a
        backend). Raises 404 for an unknown model, 400 for a pin header naming a foreign backend, 503 when
        no target is available. The in-flight count of the target goes up now, before any await, so
        concurrent arrivals see each other. ``model`` may be an alias."""
        routes = self._models.get(self.aliases.get(model, model))
        if routes is None:
            raise model_not_found(model)
        started = time.time_ns() if self.tracing is not None else 0
        target, via = routes.choose(request, headers)
        pair = None
        if routes.shadow is not None and via != "pinned":
            pair = routes.shadow.mirror(target.name, request, factory)
        if self.tracing is not None:
            shadow = routes.shadow.name if pair is not None and routes.shadow is not None else None
            self.tracing.record_route(started, model, target.name, via, shadow)
        return RoutedStream(routes, target, via, factory, pair, request)

    def served_name(self, model: str) -> str:
        """The served model a client's name stands for (itself, or the model it is an alias of); a 404 when no
        model answers to it. Routes, metrics and response bodies use this name, so an alias is the model."""
        if model in self._models:
            return model
        served = self.aliases.get(model)
        if served is None:
            raise model_not_found(model)
        return served

    def model_routes(self, model: str) -> ModelRoutes:
        """One model's routes (operators, benchmarks); KeyError if the model is not served."""
        return self._models[model]

    def target(self, model: str, backend: str) -> Target:
        """One model's target by backend name (operators, tests); KeyError if there is none."""
        return self._models[model].targets[backend]

    def backends_of(self, model: str) -> list[Backend]:
        """The backends that may serve the model's clients (targets and fallbacks, not the shadow)."""
        routes = self._models.get(model)
        return [t.backend for t in routes.targets.values()] if routes is not None else []

    def backend_kinds(self, model: str) -> list[str]:
        return list(dict.fromkeys(b.kind for b in self.backends_of(model)))

    def targets(self) -> Iterator[Target]:
        for routes in self._models.values():
            yield from routes.targets.values()

    def shadows(self) -> Iterator[ShadowMirror]:
        for routes in self._models.values():
            if routes.shadow is not None:
                yield routes.shadow

    def describe(self) -> dict[str, Any]:
        """The operator view: every model's targets with health, load, circuit, latency, and shadow summary."""
        return {"models": {name: routes.describe() for name, routes in self._models.items()}}

    async def aclose(self) -> None:
        """Cancels shadow work (at shutdown, before the backends stop)."""
        await asyncio.gather(*(s.aclose() for s in self.shadows()))

"""A backend over LMDeploy ``api_server`` nodes, reached with one pooled aiohttp client.

Per request: translate (``translate.py``), pick the healthy node with the fewest requests in flight
(``nodes.py``), send each choice there and stream LMDeploy's SSE into events (``upstream.py``, ``stream.py``),
enforce stop strings, and fail over to another node only while nothing has been handed to the gateway yet.
``n > 1`` runs one upstream request per choice (choice ``i`` with ``seed + i``), so each choice can be stopped on
its own. Closing the event iterator closes the upstream response, and LMDeploy then cancels the engine request.

aiohttp rather than httpx, by measurement against the harness (LMDeploy 0.18.0 api_server, stub engine, 30-token
streams): 1.45 ms vs 2.6-3.7 ms of client CPU per request at concurrency 1 and 1.2 ms vs 7.0-8.0 ms at 64, with
lower latency; see docs/lmdeploy.md and ``bench/lmdeploy_overhead.py --clients``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing

import aiohttp
from prometheus_client.metrics_core import Metric

from backends.config import LMDeployBackendConfig
from backends.deepseek.image_fetch import ImageUrlFetcher, ImageUrlSettings
from backends.errors import UnavailableError
from backends.interface import Delta, Event, Finish, GenerateRequest, PromptEcho, Usage, reject_unsupported
from backends.lmdeploy.connections import probe_session, request_session
from backends.lmdeploy.errors import UpstreamFailure
from backends.lmdeploy.images import Position, image_positions, node_messages, refuse_images
from backends.lmdeploy.node_metrics import node_metric_families
from backends.lmdeploy.nodes import Node, NodePool
from backends.lmdeploy.translate import SUPPORTED_FEATURES, SUPPORTED_SAMPLING, UpstreamPlan, plan_request
from backends.lmdeploy.upstream import ChoiceDone, UpstreamClient
from backends.streams import interleave


class _Progress:
    """Whether anything of this request reached the gateway: after that, no retry on another node."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


class LMDeployBackend:
    """Serves requests from one or more LMDeploy api_server nodes."""

    kind = "lmdeploy"
    supported_sampling = SUPPORTED_SAMPLING
    supported_features = SUPPORTED_FEATURES

    def __init__(self, config: LMDeployBackendConfig) -> None:
        self.name = config.name
        self.config = config
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._headers = {"Content-Type": "application/json", **self._auth}
        self.pool = NodePool(
            [str(url).rstrip("/") for url in config.urls],
            model=config.model,
            node_kind=config.node_kind,
            headers=self._auth,
            health_interval=config.health_interval,
            health_timeout=config.health_timeout,
            failure_threshold=config.failure_threshold,
            backend=config.name,
            vision=config.vision,
        )
        self.images = ImageUrlFetcher(ImageUrlSettings.of(config.image_urls))
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamClient | None = None
        self._started = False
        self._starting = False
        self.connections_created = 0

    # lifecycle
    async def start(self) -> None:
        self._starting = True
        try:
            self._session = request_session(self.config, self._connection_created)
            self._upstream = UpstreamClient(self.config, self._session, self._headers)
            self._probe_session = probe_session()
            await self.pool.start(self._probe_session)
            self._started = True
        finally:
            self._starting = False

    def _connection_created(self) -> None:
        self.connections_created += 1

    async def stop(self) -> None:
        self._started = False
        await self.pool.stop()
        for session in (self._session, self._probe_session):
            if session is not None:
                await session.close()
        self._session = self._probe_session = None
        self._upstream = None
        self.images.close()

    def readiness(self) -> tuple[bool, str]:
        if not self._started:
            return False, "starting" if self._starting else "not started"
        healthy = self.pool.healthy_count()
        if healthy == 0:
            return False, f"no healthy LMDeploy node ({self.pool.describe()})"
        return True, f"{healthy}/{len(self.pool.nodes)} LMDeploy nodes healthy"

    def max_model_len(self) -> int | None:
        return self.config.max_model_len

    @property
    def in_flight(self) -> int:
        return sum(node.in_flight for node in self.pool.nodes)

    # requests
    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        if not self._started or self._upstream is None:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}", retry_after=5)
        reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
        positions = image_positions(request.messages) if request.messages else []
        if positions:
            request = await self._with_node_images(request, positions)
        plan = plan_request(request, self.config.max_model_len)
        plan.vision = bool(positions)
        model = self.config.model_map.get(request.model) or self.config.model
        progress = _Progress()
        if request.echo and request.prompt is not None:
            for index in range(request.n):
                yield PromptEcho(index, request.prompt)
        if request.n == 1:
            choices = self._choice(request, plan, 0, model, progress)
        else:
            choices = self._merged(request, plan, model, progress)
        done: list[ChoiceDone] = []
        try:
            async for event in choices:
                if isinstance(event, ChoiceDone):
                    done.append(event)
                    continue
                progress.sent = True
                yield event
        finally:
            await choices.aclose()
        prompt_tokens = next((d.prompt_tokens for d in done if d.prompt_tokens is not None), None)
        if prompt_tokens is not None and len(done) == request.n:
            reasoning = [d.reasoning_tokens for d in done if d.reasoning_tokens is not None]
            completion = sum(d.completion_tokens for d in done)
            cached = min(d.cached_tokens for d in done)  # the prompt is counted once: the hits every choice had
            yield Usage(prompt_tokens, completion, sum(reasoning) if reasoning else None, cached)

    async def _with_node_images(self, request: GenerateRequest, positions: list[Position]) -> GenerateRequest:
        """The request with its images as a vision node may receive them (``images.py``), or a 400 without one."""
        assert request.messages is not None
        if not self.pool.serves_vision():
            raise refuse_images(request.messages, positions[0])
        return dataclasses.replace(request, messages=await node_messages(request.messages, positions, self.images))

    async def _merged(
        self, request: GenerateRequest, plan: UpstreamPlan, model: str | None, progress: _Progress
    ) -> AsyncGenerator[Delta | Finish | ChoiceDone, None]:
        """Runs the n choices concurrently (one upstream request each) and interleaves their events."""
        choices = [self._choice(request, plan, i, model, progress) for i in range(request.n)]
        async with aclosing(interleave(choices)) as merged:
            async for _, event in merged:
                yield event

    async def _choice(
        self, request: GenerateRequest, plan: UpstreamPlan, index: int, model: str | None, progress: _Progress
    ) -> AsyncGenerator[Delta | Finish | ChoiceDone, None]:
        """One choice on one node; before anything reached the gateway, a failing node is replaced by another."""
        tried: set[Node] = set()
        retried_stale = False
        last: UpstreamFailure | None = None
        retries = 0
        while True:
            node = self.pool.choose(tried, vision=plan.vision)
            if node is None:
                if last is not None:
                    raise last.error
                serving = "LMDeploy node serving a vision model" if plan.vision else "LMDeploy node"
                raise UnavailableError(
                    f"no healthy {serving} in backend {self.name!r} ({self.pool.describe()})", retry_after=5
                )
            tried.add(node)
            upstream = self._upstream
            assert upstream is not None
            try:
                async with aclosing(upstream.stream_choice(node, request, plan, index, model)) as attempt:
                    async for event in attempt:
                        yield event
                self.pool.succeeded(node)
                return
            except UpstreamFailure as failure:
                if failure.kind == "stale" and not retried_stale and not progress.sent:
                    # A pooled keep-alive connection the node had just closed: same node, fresh connection.
                    node.count_error("stale_connection")
                    retried_stale = True
                    tried.discard(node)
                    continue
                if failure.node_fault:
                    self.pool.failed(node, failure.kind, failure.error.message)
                else:
                    node.count_error(failure.kind)
                if progress.sent or not failure.retryable or retries >= self.config.retries:
                    raise failure.error from None
                retries += 1
                node.retries_away += 1
                last = failure

    async def count_prompt_tokens(self, request: GenerateRequest) -> int | None:
        """``PromptCountingBackend``: a node's own count (``/v1/messages/count_tokens``, no engine work), for the
        plain-text conversations where it is exact; else None (a proxy has no such route)."""
        node = self.pool.choose()
        if self._upstream is None or node is None or node.kind == "proxy" or request.messages is None:
            return None
        model = self.config.model_map.get(request.model) or self.config.model or node.model or ""
        return await self._upstream.count_prompt_tokens(node, request, model)

    # metrics
    def metric_families(self) -> list[Metric]:
        """Per-node metrics, read at scrape time (labels: backend, node)."""
        return node_metric_families(self.name, self.pool, self.connections_created)


def build_lmdeploy_backend(config: LMDeployBackendConfig) -> LMDeployBackend:
    return LMDeployBackend(config)


__all__ = ["LMDeployBackend", "build_lmdeploy_backend"]

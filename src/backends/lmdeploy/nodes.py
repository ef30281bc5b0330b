"""The LMDeploy nodes of one backend: which are healthy, which one takes the next request, what each has done.

Health is active and passive. Every ``health_interval`` each node's ``GET /health`` is probed (it needs no API
key); 200 is in unless its status is ``sleeping`` (LMDeploy answers 200 while asleep but refuses inference;
other OpenAI-compatible servers answer 200 with another body, e.g. ``{"status": "ok"}``), anything else is out.
LMDeploy caches the status for about 12 s, so an engine failure may show late, a dead process at once. Between
probes, requests count failures: a refused connection takes the node out at once, ``failure_threshold``
consecutive failures of other kinds too. A node that is out comes back at its next good probe.

A url may be an LMDeploy proxy instead (``node_kind: proxy``, or ``auto``: its ``/health`` is 404 and its
``/nodes/status`` answers). Its health is its own view of its nodes plus ``/v1/models`` (see ``proxy.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
import orjson

from backends.lmdeploy.proxy import ProxyView, proxy_view
from backends.lmdeploy.vision import probe_vision

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Node:
    """One api_server node and its counters (read by the metrics collector at scrape time)."""

    url: str
    kind: str = "auto"  # "api_server" or "proxy" (lmdeploy serve proxy); "auto" until the first probe tells
    proxy_view: ProxyView | None = None  # a proxy's nodes for the model, as its last /nodes/status listed them
    healthy: bool = False
    reason: str = "not probed yet"
    model: str | None = None  # served model name, configured or discovered from /v1/models
    vision: bool | None = None  # serves a vision model: configured, or the node's answer to a probe (vision.py)
    in_flight: int = 0
    consecutive_failures: int = 0
    requests: int = 0
    retries_away: int = 0  # requests that left this node for another one before their first byte
    errors: dict[str, int] = field(default_factory=dict)
    first_byte_seconds: float = 0.0
    first_byte_count: int = 0
    request_seconds: float = 0.0
    request_count: int = 0
    probes_failed: int = 0
    last_probe: float = 0.0

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class NodePool:
    """Nodes, the least-outstanding choice among the healthy ones, and the health-probe loop."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        model: str | None,
        node_kind: str = "auto",
        headers: dict[str, str],
        health_interval: float,
        health_timeout: float,
        failure_threshold: int,
        backend: str,
        vision: str = "auto",
    ) -> None:
        self.nodes = [Node(url) for url in urls]
        for node in self.nodes:
            node.model = model
            node.kind = node_kind
            node.vision = None if vision == "auto" else vision == "on"
        self._discover = model is None
        self._headers = headers
        self._interval = health_interval
        self._probe_timeout = aiohttp.ClientTimeout(total=health_timeout)
        self._threshold = failure_threshold
        self._backend = backend
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # choosing
    def choose(self, exclude: set[Node] | frozenset[Node] = frozenset(), *, vision: bool = False) -> Node | None:
        """The healthy node with the fewest requests in flight (one serving a vision model if ``vision``); ties go
        round-robin so load spreads."""
        nodes = self.nodes
        count = len(nodes)
        start = self._turn
        self._turn = (start + 1) % count
        best: Node | None = None
        for offset in range(count):
            node = nodes[(start + offset) % count]
            if not node.healthy or node.model is None or node in exclude or (vision and not node.vision):
                continue
            if best is None or node.in_flight < best.in_flight:
                best = node
        return best

    def serves_vision(self) -> bool:
        """Whether any node is known to serve a vision model (healthy or not: a node that is out may return)."""
        return any(node.vision for node in self.nodes)

    def healthy_count(self) -> int:
        return sum(1 for n in self.nodes if n.healthy and n.model is not None)

    def describe(self) -> str:
        return "; ".join(f"{n.url}: {'healthy' if n.healthy else n.reason}" for n in self.nodes)

    # passive health
    def succeeded(self, node: Node) -> None:
        node.consecutive_failures = 0

    def failed(self, node: Node, kind: str, message: str) -> None:
        node.count_error(kind)
        node.consecutive_failures += 1
        if node.healthy and (kind == "connect" or node.consecutive_failures >= self._threshold):
            node.healthy = False
            node.reason = f"taken out after {node.consecutive_failures} failed request(s): {message}"
            logger.warning("lmdeploy node %s of %s taken out: %s", node.url, self._backend, message)
            self._wake.set()

    # active health
    async def start(self, session: aiohttp.ClientSession) -> None:
        """First probe round (so a healthy pool is ready when start returns), then the periodic loop."""
        self._session = session
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name=f"lmdeploy-health-{self._backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval)
                self._wake.clear()
                await asyncio.sleep(min(self._interval, 0.5))  # a node just taken out: re-probe it soon, not now
            except TimeoutError:
                pass
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(node) for node in self.nodes))

    async def _probe(self, node: Node) -> None:
        assert self._session is not None
        node.last_probe = time.time()
        try:
            if node.kind == "proxy":
                await self._probe_proxy(node)
                return
            async with self._session.get(f"{node.url}/health", timeout=self._probe_timeout) as response:
                body = await response.read()
            if response.status == 404 and node.kind == "auto" and await self._is_proxy(node):
                logger.info("lmdeploy node %s of %s is an LMDeploy proxy", node.url, self._backend)
                node.kind = "proxy"
                await self._probe_proxy(node)
                return
            status = _health_status(body)
            if response.status != 200 or status == "sleeping":
                self._mark_out(node, f"/health answered HTTP {response.status} {status or body[:100]!r}")
                return
            if self._discover and node.model is None:
                node.model = await self._discover_model(node)
                if node.model is None:
                    self._mark_out(node, "GET /v1/models listed no model")
                    return
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._mark_out(node, f"unreachable: {type(exc).__name__}: {exc}".rstrip(": "))
            return
        if node.kind == "auto":
            node.kind = "api_server"
        self._mark_in(node, "healthy")
        await self._learn_vision(node)

    async def _learn_vision(self, node: Node) -> None:
        """Asks a healthy node whose vision is unknown whether it takes images (``vision.py``)."""
        if node.vision is None and node.model is not None and self._session is not None:
            node.vision = await probe_vision(self._session, node.url, node.model, self._headers, self._probe_timeout)
            if node.vision is not None:
                logger.info(
                    "lmdeploy node %s of %s serves a %s model",
                    node.url,
                    self._backend,
                    "vision" if node.vision else "text-only",
                )

    def _mark_in(self, node: Node, reason: str) -> None:
        if not node.healthy:
            logger.info("lmdeploy node %s of %s is healthy (model %s): %s", node.url, self._backend, node.model, reason)
        node.healthy = True
        node.reason = reason
        node.consecutive_failures = 0

    async def _is_proxy(self, node: Node) -> bool:
        """Whether a url without ``/health`` is an LMDeploy proxy: its ``/nodes/status`` answers with an object."""
        assert self._session is not None
        async with self._session.get(f"{node.url}/nodes/status", timeout=self._probe_timeout) as response:
            if response.status != 200:
                return False
            body = await response.read()
        try:
            return isinstance(orjson.loads(body), dict)
        except orjson.JSONDecodeError:
            return False

    async def _probe_proxy(self, node: Node) -> None:
        """A proxy is healthy while its own view of its nodes can serve the model (``/nodes/status``) and it
        answers ``/v1/models`` with the gateway's key, listing that model (see ``proxy.py``)."""
        assert self._session is not None
        node.proxy_view = None
        async with self._session.get(f"{node.url}/nodes/status", timeout=self._probe_timeout) as response:
            body = await response.read()
        if response.status != 200:
            self._mark_out(node, f"proxy /nodes/status answered HTTP {response.status} {body[:100]!r}")
            return
        try:
            listed = await self._discover_model(node, node.model)
        except aiohttp.ClientResponseError as exc:
            self._mark_out(node, f"proxy /v1/models answered HTTP {exc.status}")
            return
        if self._discover and node.model is None:
            node.model = listed
        try:
            view = proxy_view(orjson.loads(body), node.model)
        except (orjson.JSONDecodeError, ValueError) as exc:
            self._mark_out(node, f"proxy /nodes/status unreadable: {exc}")
            return
        node.proxy_view = view
        reason = view.describe(node.model)
        if not view.serving or listed is None:
            self._mark_out(node, reason)
            return
        self._mark_in(node, reason)
        await self._learn_vision(node)

    def _mark_out(self, node: Node, reason: str) -> None:
        node.probes_failed += 1
        if node.healthy:
            logger.warning("lmdeploy node %s of %s failed its health probe: %s", node.url, self._backend, reason)
        node.healthy = False
        node.reason = reason

    async def _discover_model(self, node: Node, wanted: str | None = None) -> str | None:
        """The model ``/v1/models`` lists (``wanted`` if given and listed, else the first; None if not listed)."""
        assert self._session is not None
        async with self._session.get(
            f"{node.url}/v1/models", headers=self._headers, timeout=self._probe_timeout
        ) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message="GET /v1/models failed"
                )
            listing = orjson.loads(await response.read())
        ids = [entry.get("id") for entry in listing.get("data") or () if isinstance(entry, dict)]
        if wanted is not None:
            return wanted if wanted in ids else None
        return ids[0] if ids else None


def _health_status(body: bytes) -> str | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed.get("status") if isinstance(parsed, dict) else None

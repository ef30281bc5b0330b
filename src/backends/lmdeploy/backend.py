"""A backend over LMDeploy ``api_server`` nodes, reached with one pooled aiohttp client.

Per request: translate (``translate.py``), pick the healthy node with the fewest requests in flight
(``nodes.py``), stream LMDeploy's SSE into events (``stream.py``; the text of chunks that arrived in one network
read goes on as one event), enforce stop strings, and fail over to another node only while nothing has been handed
to the gateway yet. ``n > 1`` runs one upstream request per choice (choice ``i`` with ``seed + i``), so each
choice can be stopped on its own. Closing the event iterator closes the upstream response, and LMDeploy then
cancels the engine request.

aiohttp rather than httpx, by measurement against the harness (LMDeploy 0.18.0 api_server, stub engine, 30-token
streams): 1.45 ms vs 2.6-3.7 ms of client CPU per request at concurrency 1 and 1.2 ms vs 7.0-8.0 ms at 64, with
lower latency; see docs/lmdeploy.md and ``bench/lmdeploy_overhead.py --clients``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, NamedTuple

import aiohttp
import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import Metric

from backends.config import LMDeployBackendConfig
from backends.errors import BackendTimeoutError, UnavailableError
from backends.interface import Delta, Event, Finish, GenerateRequest, PromptEcho, Usage, reject_unsupported
from backends.lmdeploy.errors import UpstreamFailure, failure_from_status, node_failure
from backends.lmdeploy.nodes import Node, NodePool
from backends.lmdeploy.stream import DONE, ChoiceStream, SSEReader, coalesce
from backends.lmdeploy.translate import SUPPORTED_FEATURES, SUPPORTED_SAMPLING, UpstreamPlan, plan_request
from backends.streams import interleave

logger = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024


class _ChoiceDone(NamedTuple):
    """Internal: a choice's token counts (prompt_tokens is None when LMDeploy could not report it)."""

    index: int
    prompt_tokens: int | None
    completion_tokens: int
    reasoning_tokens: int | None


class _Progress:
    """Whether anything of this request reached the gateway: after that, no retry on another node."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


class _CountingConnector(aiohttp.TCPConnector):
    """Counts the connections it opens (``gateway_lmdeploy_connections_created``). A ``TraceConfig`` would do it
    through the public API, but then aiohttp builds trace parameters and sends signals for every request."""

    def __init__(self, created: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._created = created

    async def _create_connection(self, *args: Any, **kwargs: Any) -> Any:
        connection = await super()._create_connection(*args, **kwargs)
        self._created()
        return connection


class _Watchdog:
    """Closes a streaming response that stays silent too long or outlives its deadline.

    One timer per request, re-armed lazily: a chunk only records the time it arrived, so the hot path costs one
    clock read. Closing the response (instead of cancelling the task) never interrupts the gateway's own code.
    """

    __slots__ = ("_deadline", "_handle", "_idle", "_loop", "_response", "fired", "since")

    def __init__(self, loop: asyncio.AbstractEventLoop, response: aiohttp.ClientResponse, idle: float, deadline: float):
        self._loop = loop
        self._response = response
        self._idle = idle
        self._deadline = deadline
        self.since = loop.time()
        self.fired: str | None = None
        self._handle = loop.call_at(min(self.since + idle, deadline), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._deadline:
            self.fired = "deadline"
        elif now >= self.since + self._idle:
            self.fired = "idle"
        else:
            self._handle = self._loop.call_at(min(self.since + self._idle, self._deadline), self._check)
            return
        self._response.close()

    def cancel(self) -> None:
        self._handle.cancel()


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
            headers=self._auth,
            health_interval=config.health_interval,
            health_timeout=config.health_timeout,
            failure_threshold=config.failure_threshold,
            backend=config.name,
        )
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._started = False
        self._starting = False
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout, sock_connect=config.connect_timeout, sock_read=None
        )
        self._first_byte_timeout = config.first_byte_timeout or config.read_timeout
        self.connections_created = 0

    # lifecycle
    async def start(self) -> None:
        self._starting = True
        try:
            connector = _CountingConnector(
                self._connection_created,
                limit=self.config.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.config.keepalive_timeout,
            )
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
            # Probes get their own connections (closed after each probe): they never take a pooled connection
            # from requests, and the connection counter stays a measure of requests alone.
            self._probe_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), skip_auto_headers=("User-Agent",)
            )
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
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if not self._started or self._session is None:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}", retry_after=5)
        reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
        plan = plan_request(request, self.config.max_model_len)
        model = self.config.model_map.get(request.model) or self.config.model
        progress = _Progress()
        if request.echo and request.prompt is not None:
            for index in range(request.n):
                yield PromptEcho(index, request.prompt)
        if request.n == 1:
            choices = self._choice(request, plan, 0, model, progress)
        else:
            choices = self._merged(request, plan, model, progress)
        done: list[_ChoiceDone] = []
        try:
            async for event in choices:
                if isinstance(event, _ChoiceDone):
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
            yield Usage(prompt_tokens, completion, sum(reasoning) if reasoning else None)

    async def _merged(
        self, request: GenerateRequest, plan: UpstreamPlan, model: str | None, progress: _Progress
    ) -> AsyncIterator[Delta | Finish | _ChoiceDone]:
        """Runs the n choices concurrently (one upstream request each) and interleaves their events."""
        choices = [self._choice(request, plan, i, model, progress) for i in range(request.n)]
        async with aclosing(interleave(choices)) as merged:
            async for _, event in merged:
                yield event

    async def _choice(
        self, request: GenerateRequest, plan: UpstreamPlan, index: int, model: str | None, progress: _Progress
    ) -> AsyncIterator[Delta | Finish | _ChoiceDone]:
        """One choice on one node; before anything reached the gateway, a failing node is replaced by another."""
        tried: set[Node] = set()
        retried_stale = False
        last: UpstreamFailure | None = None
        retries = 0
        while True:
            node = self.pool.choose(tried)
            if node is None:
                if last is not None:
                    raise last.error
                raise UnavailableError(
                    f"no healthy LMDeploy node in backend {self.name!r} ({self.pool.describe()})", retry_after=5
                )
            tried.add(node)
            try:
                async with aclosing(self._attempt(node, request, plan, index, model)) as attempt:
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

    async def _attempt(
        self, node: Node, request: GenerateRequest, plan: UpstreamPlan, index: int, model: str | None
    ) -> AsyncIterator[Delta | Finish | _ChoiceDone]:
        session = self._session
        assert session is not None
        loop = asyncio.get_running_loop()
        upstream_model = model or node.model or ""
        body = orjson.dumps(plan.body_for(index, upstream_model))
        stream = ChoiceStream(
            index,
            chat=plan.chat,
            stops=request.sampling.stop,
            want_top=plan.want_top_logprobs,
            byte_level=self.config.logprob_tokens == "byte_level",
            node=node.url,
        )
        started = loop.time()
        deadline = started + self.config.total_timeout if self.config.total_timeout else float("inf")
        if request.deadline is not None:
            deadline = min(deadline, request.deadline)
        headers = self._headers
        if request.trace is not None:  # the upstream request joins the client's trace
            headers = {**headers, **request.trace.headers()}
            request.trace.annotate("gateway.lmdeploy.node", node.url)
        node.in_flight += 1
        node.requests += 1
        response: aiohttp.ClientResponse | None = None
        watchdog: _Watchdog | None = None
        complete = False
        try:
            try:
                async with asyncio.timeout_at(min(started + self._first_byte_timeout, deadline)):
                    response = await session.post(
                        node.url + plan.path, data=body, headers=headers, timeout=self._request_timeout
                    )
                    if response.status != 200:
                        raise failure_from_status(response.status, await _bounded_body(response), node.url)
                    reader = SSEReader(response.content, node=node.url)
                    payload = await reader.next()
            except TimeoutError:
                raise _timeout_failure(node, "first byte", loop.time() >= deadline, retryable=True) from None
            except aiohttp.ClientConnectorError as exc:
                raise node_failure(f"cannot connect to LMDeploy node {node.url}: {exc}", kind="connect") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                raise node_failure(f"LMDeploy node {node.url} closed the connection: {exc!r}", kind="stale") from exc
            except aiohttp.ClientError as exc:
                raise node_failure(f"LMDeploy node {node.url} failed: {exc!r}", kind="disconnect") from exc
            node.first_byte_seconds += loop.time() - started
            node.first_byte_count += 1
            watchdog = _Watchdog(loop, response, self.config.read_timeout, deadline)
            while payload is not None and payload != DONE:
                events = stream.feed(payload)
                payload = reader.ready()  # chunks of the same network read go on as one event
                failed: Exception | None = None
                while payload is not None and payload != DONE and not stream.stopped_early:
                    try:
                        events = coalesce(events, stream.feed(payload))
                    except Exception as exc:  # a bad chunk: what came before it still goes out first
                        failed = exc
                        break
                    payload = reader.ready()
                for event in events:
                    yield event
                if failed is not None:
                    raise failed
                if stream.stopped_early:
                    break
                watchdog.since = loop.time()
                if payload is not None:
                    continue
                try:
                    payload = await reader.next()
                except aiohttp.ClientError as exc:
                    if watchdog.fired:
                        raise _timeout_failure(node, "next chunk", watchdog.fired == "deadline") from exc
                    message = f"LMDeploy node {node.url} broke the stream: {exc!r}"
                    raise node_failure(message, kind="disconnect") from exc
            if not stream.stopped_early:
                if payload is None:  # the body ended without [DONE]
                    if watchdog.fired:
                        raise _timeout_failure(node, "next chunk", watchdog.fired == "deadline")
                    if not stream.finished:
                        raise node_failure(f"LMDeploy node {node.url} ended the stream early", kind="disconnect")
                elif not stream.finished:
                    message = f"LMDeploy node {node.url} ended the stream without a finish reason"
                    raise node_failure(message, kind="protocol")
                else:
                    await reader.drain()  # the chunked terminator: then the connection goes back to the pool
                    complete = True
            prompt_tokens: int | None
            if stream.usage is not None and not (stream.stopped_early and plan.chat):
                prompt_tokens, completion_tokens = stream.usage
            else:
                completion_tokens = stream.tokens
                prompt_tokens = stream.usage[0] if stream.usage else None
                if prompt_tokens is None and plan.chat:
                    if response is not None:
                        response.close()  # stop the engine before asking the node to count
                    prompt_tokens = await self._count_prompt_tokens(node, request, upstream_model)
            reasoning_tokens = None if stream.stopped_early else stream.reasoning_tokens
            yield _ChoiceDone(index, prompt_tokens, completion_tokens, reasoning_tokens)
        finally:
            node.in_flight -= 1
            node.request_seconds += loop.time() - started
            node.request_count += 1
            if watchdog is not None:
                watchdog.cancel()
            if response is not None:
                if complete:
                    response.release()
                else:
                    response.close()  # LMDeploy sees the disconnect and cancels the engine request

    async def _count_prompt_tokens(self, node: Node, request: GenerateRequest, model: str) -> int | None:
        """Prompt tokens of a chat the gateway ended at a stop string (LMDeploy reports usage only at the end).

        Asks the node's tokenize-only ``/v1/messages/count_tokens`` with the same template and tokenizer; only for
        plain-text conversations, where that count is exact. Otherwise None: no usage rather than a wrong one.
        """
        if request.tools or request.chat_template_kwargs or request.thinking is not None or request.reasoning_effort:
            return None
        messages = []
        for message in request.messages or ():
            content = message.get("content")
            if message.get("role") not in ("system", "user", "assistant") or not isinstance(content, str):
                return None
            if message.get("tool_calls"):
                return None
            messages.append({"role": message["role"], "content": content})
        assert self._session is not None
        try:
            async with self._session.post(
                f"{node.url}/v1/messages/count_tokens",
                data=orjson.dumps({"model": model, "messages": messages}),
                headers={**self._headers, "anthropic-version": "2023-06-01"},
                timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout + self.config.health_timeout),
            ) as response:
                if response.status != 200:
                    return None
                counted = orjson.loads(await response.read()).get("input_tokens")
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            logger.warning("lmdeploy node %s: counting prompt tokens failed: %r", node.url, exc)
            return None
        return counted if isinstance(counted, int) else None

    # metrics
    def metric_families(self) -> list[Metric]:
        """Per-node metrics, read at scrape time (labels: backend, node)."""
        labels = ["backend", "node"]
        healthy = GaugeMetricFamily(
            "gateway_lmdeploy_node_healthy", "1 while the LMDeploy node passes health checks.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "gateway_lmdeploy_node_requests_in_flight", "Upstream requests open on the node.", labels=labels
        )
        requests = CounterMetricFamily(
            "gateway_lmdeploy_node_requests", "Upstream requests sent to the node.", labels=labels
        )
        errors = CounterMetricFamily(
            "gateway_lmdeploy_node_errors", "Failed upstream requests by kind.", labels=[*labels, "kind"]
        )
        retries = CounterMetricFamily(
            "gateway_lmdeploy_node_failovers",
            "Requests moved from this node to another before their first byte.",
            labels=labels,
        )
        probes = CounterMetricFamily(
            "gateway_lmdeploy_node_health_probe_failures", "Failed /health probes.", labels=labels
        )
        first_byte = SummaryMetricFamily(
            "gateway_lmdeploy_node_first_byte_seconds",
            "Time from sending a request to its first stream event.",
            labels=labels,
        )
        duration = SummaryMetricFamily(
            "gateway_lmdeploy_node_request_seconds", "Upstream request duration.", labels=labels
        )
        connections = CounterMetricFamily(
            "gateway_lmdeploy_connections_created",
            "TCP connections the backend's pooled client opened (keep-alive reuse keeps this flat).",
            labels=["backend"],
        )
        for node in self.pool.nodes:
            values = [self.name, node.url]
            healthy.add_metric(values, 1.0 if node.healthy else 0.0)
            in_flight.add_metric(values, node.in_flight)
            requests.add_metric(values, node.requests)
            retries.add_metric(values, node.retries_away)
            probes.add_metric(values, node.probes_failed)
            for kind, count in node.errors.items():
                errors.add_metric([*values, kind], count)
            first_byte.add_metric(values, count_value=node.first_byte_count, sum_value=node.first_byte_seconds)
            duration.add_metric(values, count_value=node.request_count, sum_value=node.request_seconds)
        connections.add_metric([self.name], self.connections_created)
        return [healthy, in_flight, requests, errors, retries, probes, first_byte, duration, connections]


def _timeout_failure(node: Node, what: str, deadline: bool, *, retryable: bool = False) -> UpstreamFailure:
    if deadline:
        error = BackendTimeoutError(f"the request ran past its deadline waiting for LMDeploy node {node.url}")
        return UpstreamFailure(error, retryable=False, node_fault=False, kind="deadline")
    error = BackendTimeoutError(f"LMDeploy node {node.url} sent no {what} in time")
    return UpstreamFailure(error, retryable=retryable, node_fault=True, kind="timeout")


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes:
    return await response.content.read(ERROR_BODY_LIMIT)


def build_lmdeploy_backend(config: LMDeployBackendConfig) -> LMDeployBackend:
    return LMDeployBackend(config)


__all__ = ["LMDeployBackend", "build_lmdeploy_backend"]

"""One choice's request to one LMDeploy node: send it, read its SSE into events (chunks of one network read go
on as one event), time it out (first byte, silence, deadline: each a ``backends.deadlines.Deadline`` over the reads
from the node), and release its connection to the pool or close it (LMDeploy then cancels the engine request)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import NamedTuple

import aiohttp
import orjson

from backends.config import LMDeployBackendConfig
from backends.deadlines import Deadline, DeadlineExpired
from backends.errors import BackendTimeoutError
from backends.interface import Delta, Finish, GenerateRequest
from backends.lmdeploy.errors import UpstreamFailure, failure_from_status, node_failure
from backends.lmdeploy.nodes import Node
from backends.lmdeploy.proxy import proxy_lost_model
from backends.lmdeploy.stream import DONE, ChoiceStream, SSEReader, coalesce
from backends.lmdeploy.translate import UpstreamPlan

logger = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024


class ChoiceDone(NamedTuple):
    """The end of a choice on its node: its's token counts (prompt_tokens is None when LMDeploy could not report it)."""

    index: int  # type: ignore[assignment]  # the choice's index, as on Delta and Finish; shadows tuple.index
    prompt_tokens: int | None
    completion_tokens: int
    reasoning_tokens: int | None
    cached_tokens: int = 0  # of the prompt, the node's prefix-cache hits as it reported them (0 if it did not)


class _Connection:
    """The node's response to one choice, and whether it was read to its end (then it goes back to the pool)."""

    __slots__ = ("complete", "response")

    def __init__(self) -> None:
        self.response: aiohttp.ClientResponse | None = None
        self.complete = False

    def close(self) -> None:
        if self.response is not None:
            if self.complete:
                self.response.release()
            else:
                self.response.close()  # LMDeploy sees the disconnect and cancels the engine request


class UpstreamClient:
    """Sends one backend's choices to its nodes on the backend's pooled session."""

    def __init__(self, config: LMDeployBackendConfig, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self._config = config
        self._session = session
        self._headers = headers
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout, sock_connect=config.connect_timeout, sock_read=None
        )
        self._first_byte_timeout = config.first_byte_timeout or config.read_timeout

    async def stream_choice(
        self, node: Node, request: GenerateRequest, plan: UpstreamPlan, index: int, model: str | None
    ) -> AsyncGenerator[Delta | Finish | ChoiceDone, None]:
        """Choice ``index`` of ``request`` from ``node``: its events, then its ``ChoiceDone``; raises
        ``UpstreamFailure`` (retryable or not) when the node fails it."""
        loop = asyncio.get_running_loop()
        upstream_model = model or node.model or ""
        if node.kind == "proxy":
            plan = plan.via_proxy()
        stream = ChoiceStream(
            index,
            chat=plan.chat,
            completions=plan.completions,
            stops=request.sampling.stop,
            want_top=plan.want_top_logprobs,
            byte_level=self._config.logprob_tokens == "byte_level",
            node=node.url,
        )
        started = loop.time()
        # The gateway's own request deadline needs nothing here: it closes the event iterator, which closes this
        # upstream stream. This bound is the backend's own (``total_timeout``).
        end = started + self._config.total_timeout if self._config.total_timeout else None
        headers = self._headers
        if request.trace is not None:  # the upstream request joins the client's trace
            headers = {**headers, **request.trace.headers()}
            request.trace.annotate("gateway.lmdeploy.node", node.url)
        body = orjson.dumps(plan.body_for(index, upstream_model))
        node.in_flight += 1
        node.requests += 1
        connection = _Connection()
        try:
            reader, payload = await self._first_payload(node, plan.path, body, headers, connection, end)
            node.first_byte_seconds += loop.time() - started
            node.first_byte_count += 1
            reads = Deadline(None, self._config.read_timeout, end=end)
            async for event in self._relay(node, stream, reader, payload, reads, connection):
                yield event
            yield await self._choice_done(node, request, plan, stream, upstream_model, connection)
        finally:
            node.in_flight -= 1
            node.request_seconds += loop.time() - started
            node.request_count += 1
            connection.close()

    async def _first_payload(
        self, node: Node, path: str, body: bytes, headers: dict[str, str], connection: _Connection, end: float | None
    ) -> tuple[SSEReader, bytes | None]:
        """Sends the request and reads the first payload of its stream, within the first-byte timeout."""
        first_byte = Deadline(None, self._first_byte_timeout, end=end)

        async def first() -> tuple[SSEReader, bytes | None]:
            response = connection.response = await self._session.post(
                node.url + path, data=body, headers=headers, timeout=self._request_timeout
            )
            if response.status != 200:
                failure = failure_from_status(response.status, await _bounded_body(response), node.url)
                if node.kind == "proxy" and failure.kind == "model":
                    failure = proxy_lost_model(failure.error.message, node.url)
                raise failure
            reader = SSEReader(response.content, node=node.url)
            return reader, await reader.next()

        try:
            return await first_byte.bounded(first)
        except DeadlineExpired as exc:
            raise timeout_failure(node, "first byte", exc.total, retryable=True) from None
        except TimeoutError:  # aiohttp's own connect timeout
            raise timeout_failure(node, "first byte", first_byte.expired().total, retryable=True) from None
        except aiohttp.ClientConnectorError as exc:
            raise node_failure(f"cannot connect to LMDeploy node {node.url}: {exc}", kind="connect") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise node_failure(f"LMDeploy node {node.url} closed the connection: {exc!r}", kind="stale") from exc
        except aiohttp.ClientError as exc:
            raise node_failure(f"LMDeploy node {node.url} failed: {exc!r}", kind="disconnect") from exc
        finally:
            first_byte.close()

    async def _relay(
        self,
        node: Node,
        stream: ChoiceStream,
        reader: SSEReader,
        payload: bytes | None,
        deadline: Deadline,
        connection: _Connection,
    ) -> AsyncGenerator[Delta | Finish, None]:
        """The choice's events, read from the node's stream until ``[DONE]``; each read bounded by the idle
        timeout (restarted when the read starts, so the client's own slowness never counts) and the deadline."""
        try:
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
                    return
                if payload is None:
                    payload = await _next_payload(node, reader, deadline)
        finally:
            deadline.close()
        if payload is None:  # the body ended without [DONE]
            if not stream.finished:
                raise node_failure(f"LMDeploy node {node.url} ended the stream early", kind="disconnect")
        elif not stream.finished:
            message = f"LMDeploy node {node.url} ended the stream without a finish reason"
            raise node_failure(message, kind="protocol")
        else:
            await reader.drain()  # the chunked terminator: then the connection goes back to the pool
            connection.complete = True

    async def _choice_done(
        self,
        node: Node,
        request: GenerateRequest,
        plan: UpstreamPlan,
        stream: ChoiceStream,
        model: str,
        connection: _Connection,
    ) -> ChoiceDone:
        """The choice's token counts; a chat the gateway ended at a stop string has its prompt counted by the node."""
        prompt_tokens: int | None
        if stream.usage is not None and not (stream.stopped_early and plan.chat):
            prompt_tokens, completion_tokens = stream.usage
        else:
            completion_tokens = stream.tokens
            prompt_tokens = stream.usage[0] if stream.usage else None
            if prompt_tokens is None and plan.chat and node.kind != "proxy":  # a proxy has no count_tokens
                connection.close()  # stop the engine before asking the node to count
                prompt_tokens = await self.count_prompt_tokens(node, request, model)
        reasoning_tokens = None if stream.stopped_early else stream.reasoning_tokens
        cached_tokens = min(stream.cached_tokens, prompt_tokens or 0)
        return ChoiceDone(stream.index, prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens)

    async def count_prompt_tokens(self, node: Node, request: GenerateRequest, model: str) -> int | None:
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
        try:
            async with self._session.post(
                f"{node.url}/v1/messages/count_tokens",
                data=orjson.dumps({"model": model, "messages": messages}),
                headers={**self._headers, "anthropic-version": "2023-06-01"},
                timeout=aiohttp.ClientTimeout(total=self._config.connect_timeout + self._config.health_timeout),
            ) as response:
                if response.status != 200:
                    return None
                counted = orjson.loads(await response.read()).get("input_tokens")
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            logger.warning("lmdeploy node %s: counting prompt tokens failed: %r", node.url, exc)
            return None
        return counted if isinstance(counted, int) else None


async def _next_payload(node: Node, reader: SSEReader, deadline: Deadline) -> bytes | None:
    """The stream's next payload (None at the body's end), within ``deadline``."""
    deadline.touch()
    try:
        return await deadline.bounded(reader.next)
    except DeadlineExpired as exc:
        raise timeout_failure(node, "next chunk", exc.total) from None
    except aiohttp.ClientError as exc:
        raise node_failure(f"LMDeploy node {node.url} broke the stream: {exc!r}", kind="disconnect") from exc


def timeout_failure(node: Node, what: str, deadline: bool, *, retryable: bool = False) -> UpstreamFailure:
    if deadline:
        error = BackendTimeoutError(f"the request ran past its deadline waiting for LMDeploy node {node.url}")
        return UpstreamFailure(error, retryable=False, node_fault=False, kind="deadline")
    error = BackendTimeoutError(f"LMDeploy node {node.url} sent no {what} in time")
    return UpstreamFailure(error, retryable=retryable, node_fault=True, kind="timeout")


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes:
    return await response.content.read(ERROR_BODY_LIMIT)

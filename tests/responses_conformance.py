"""Validation of Responses API bodies and stream events against the ``openai`` package's own types.

Stricter than the SDK itself: strict pydantic validation (no coercion), and no field that the types do not
know (the SDK's models accept extra fields silently, which would hide a misspelt or invented one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

_EVENT = TypeAdapter(ResponseStreamEvent)


DEEPSEEK_USAGE_FIELDS = frozenset({"prompt_cache_hit_tokens", "prompt_cache_miss_tokens"})
"""DeepSeek's cache accounting, which its API reports in every usage beside the client API's own fields."""


def _no_unknown_fields(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        extra = dict(value.model_extra or {})
        if path.endswith("usage") and extra.keys() >= DEEPSEEK_USAGE_FIELDS:
            hits, misses = extra.pop("prompt_cache_hit_tokens"), extra.pop("prompt_cache_miss_tokens")
            assert isinstance(hits, int) and isinstance(misses, int) and hits >= 0 and misses >= 0, (path, extra)
        assert not extra, f"{path}: fields the openai types do not know: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, entry in enumerate(value):
            _no_unknown_fields(entry, f"{path}[{i}]")


def check_response(body: dict[str, Any]) -> Response:
    response = Response.model_validate(body, strict=True)
    _no_unknown_fields(response, "response")
    assert body["object"] == "response"
    for key in ("status", "error", "incomplete_details", "usage", "output", "tools", "text", "reasoning"):
        assert key in body, f"response has no {key!r}"
    usage = body["usage"]
    if usage is not None:  # DeepSeek's hits and misses make the input; the hits are OpenAI's cached tokens
        assert usage["input_tokens_details"]["cached_tokens"] == usage["prompt_cache_hit_tokens"], usage
        assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["input_tokens"], usage
    return response


def check_event(payload: dict[str, Any]) -> BaseModel:
    event = _EVENT.validate_python(payload, strict=True)
    assert isinstance(event, BaseModel) and event.type == payload["type"], payload["type"]
    _no_unknown_fields(event, payload["type"])
    if "response" in payload:
        check_response(payload["response"])
    return event


def check_item_list(body: dict[str, Any]) -> ResponseItemList:
    items = ResponseItemList.model_validate(body, strict=True)
    _no_unknown_fields(items, "list")
    return items


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    """The events of a Responses stream: each ``event:`` line must name the type its ``data:`` line carries."""
    events = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            payload = orjson.loads(line[6:])
            assert payload["type"] == name, f"event: {name} carries a {payload['type']} payload"
            events.append(payload)
            name = None
    return events


def check_body(path: str, body: dict[str, Any]) -> None:
    """Any successful body of a /v1/responses route."""
    if body.get("object") == "response":
        check_response(body)
    elif body.get("object") == "list":
        check_item_list(body)
    else:
        assert body == {"id": path.rsplit("/", 1)[-1], "object": "response.deleted", "deleted": True}, body


class _EventChecker:
    """Checks the SSE events of a byte stream as they pass, whole events at a time."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._buffer = b""
        self._counts = counts

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            lines = event.decode().split("\n")
            if any(line.startswith("data: ") for line in lines):
                for payload in sse_events(lines):
                    check_event(payload)
                    self._counts["events"] += 1


class ConformingTransport(httpx.HTTPTransport):
    """The SDK's real HTTP transport, checking every /v1/responses body and stream event it hands the SDK."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"bodies": 0, "events": 0}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if not request.url.path.startswith("/v1/responses") or response.status_code != 200:
            return response
        if response.headers["content-type"].startswith("text/event-stream"):
            response.stream = _CheckedStream(response.stream, _EventChecker(self.counts))  # type: ignore[arg-type]
        else:
            check_body(request.url.path, orjson.loads(response.read()))
            self.counts["bodies"] += 1
        return response


class AsyncConformingTransport(httpx.AsyncHTTPTransport):
    """``ConformingTransport`` for the async client."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"bodies": 0, "events": 0}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if not request.url.path.startswith("/v1/responses") or response.status_code != 200:
            return response
        if response.headers["content-type"].startswith("text/event-stream"):
            response.stream = _AsyncCheckedStream(response.stream, _EventChecker(self.counts))  # type: ignore[arg-type]
        else:
            check_body(request.url.path, orjson.loads(await response.aread()))
            self.counts["bodies"] += 1
        return response


class _CheckedStream(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, checker: _EventChecker) -> None:
        self._inner = inner
        self._checker = checker

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._checker.feed(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()


class _AsyncCheckedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, checker: _EventChecker) -> None:
        self._inner = inner
        self._checker = checker

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._checker.feed(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()

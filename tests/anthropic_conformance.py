"""Validation of Messages API bodies and stream events against the ``anthropic`` package's own types.

Stricter than the SDK itself: strict pydantic validation (no coercion), no field the types do not know (the
SDK's models accept extra fields silently, which would hide a misspelt or invented one), and Anthropic's event
order: ``message_start``; per block ``content_block_start`` (indexes in order), deltas of the block's own kind,
``content_block_stop``; ``message_delta``; ``message_stop`` last; ``ping`` anywhere; an ``error`` event ends the
stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import orjson
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import BaseModel, TypeAdapter

_EVENT = TypeAdapter(RawMessageStreamEvent)
DELTAS_OF = {
    "text": {"text_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "tool_use": {"input_json_delta"},
}


DEEPSEEK_USAGE_FIELDS = frozenset({"prompt_cache_hit_tokens", "prompt_cache_miss_tokens"})
"""DeepSeek's cache accounting, which its API reports in every usage beside the client API's own fields."""


def _no_unknown_fields(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        extra = dict(value.model_extra or {})
        if path.endswith("usage") and extra.keys() >= DEEPSEEK_USAGE_FIELDS:
            hits, misses = extra.pop("prompt_cache_hit_tokens"), extra.pop("prompt_cache_miss_tokens")
            assert isinstance(hits, int) and isinstance(misses, int) and hits >= 0 and misses >= 0, (path, extra)
        assert not extra, f"{path}: fields the anthropic types do not know: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, entry in enumerate(value):
            _no_unknown_fields(entry, f"{path}[{i}]")


def check_message(body: dict[str, Any]) -> Message:
    message = Message.model_validate(body, strict=True)
    _no_unknown_fields(message, "message")
    assert message.id.startswith("msg_"), message.id
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_"), block.id
        if block.type == "thinking":
            assert block.signature, "a thinking block without a signature"
    if message.stop_reason == "stop_sequence":
        assert message.stop_sequence, "stop_reason stop_sequence without the stop_sequence"
    else:
        assert message.stop_sequence is None
    usage = message.usage
    assert usage.cache_creation_input_tokens == 0
    deepseek = usage.model_extra or {}
    # Anthropic's input_tokens leave out what was read from the cache; DeepSeek's hits and misses are the two parts.
    assert usage.cache_read_input_tokens == deepseek["prompt_cache_hit_tokens"], usage
    assert usage.input_tokens == deepseek["prompt_cache_miss_tokens"], usage
    return message


def check_error(body: dict[str, Any]) -> ErrorResponse:
    error = ErrorResponse.model_validate(body, strict=True)
    _no_unknown_fields(error, "error")
    return error


def check_count(body: dict[str, Any]) -> MessageTokensCount:
    count = MessageTokensCount.model_validate(body, strict=True)
    _no_unknown_fields(count, "count")
    return count


class EventSequence:
    """Checks one stream's events as they come: each against the SDK's types, all in Anthropic's order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the open content block
        self._blocks = 0
        self._signed = False
        self._state = "start"  # start -> blocks -> delta -> stopped | failed

    def add(self, name: str, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        assert kind == name, f"event: {name} carries a {kind} payload"
        assert self._state not in ("stopped", "failed"), f"{kind} after the stream ended"
        self.events.append(payload)
        if kind == "ping":
            assert payload == {"type": "ping"}
            return
        if kind == "error":
            check_error(payload)
            assert self._state != "start", "an error event before message_start: it should be an HTTP error"
            self._state = "failed"
            return
        event = _EVENT.validate_python(payload, strict=True)
        _no_unknown_fields(event, kind)
        if self._state == "start":
            assert kind == "message_start", f"the stream starts with {kind}"
            message = payload["message"]
            assert message["content"] == [] and message["stop_reason"] is None
            self._state = "blocks"
        elif kind == "content_block_start":
            assert self._state == "blocks" and self._open is None, "a block opened inside another"
            assert payload["index"] == self._blocks, f"block {payload['index']} opened, expected {self._blocks}"
            self._open = payload["content_block"]["type"]
            self._signed = False
        elif kind == "content_block_delta":
            assert self._open is not None and payload["index"] == self._blocks, "a delta outside its block"
            delta = payload["delta"]["type"]
            assert delta in DELTAS_OF[self._open], f"a {delta} in a {self._open} block"
            assert not self._signed, "a delta after the thinking block's signature"
            self._signed = delta == "signature_delta"
        elif kind == "content_block_stop":
            assert self._open is not None and payload["index"] == self._blocks
            if self._open == "thinking":
                assert self._signed, "a thinking block closed without its signature"
            self._open = None
            self._blocks += 1
        elif kind == "message_delta":
            assert self._state == "blocks" and self._open is None, "message_delta with a block open"
            self._state = "delta"
        else:
            assert kind == "message_stop" and self._state == "delta", "message_stop before message_delta"
            self._state = "stopped"

    def finish(self) -> None:
        assert self._state in ("stopped", "failed"), f"the stream ended in state {self._state}"


def events_of(lines: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, payload) of each SSE event: an ``event:`` line and its ``data:`` line."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            assert name is not None, f"a data line without its event line: {line[:80]}"
            yield name, orjson.loads(line[6:])
            name = None


def checked_stream(lines: list[str]) -> list[dict[str, Any]]:
    """The events of a whole stream, each checked, in order."""
    sequence = EventSequence()
    for name, payload in events_of(lines):
        sequence.add(name, payload)
    sequence.finish()
    return sequence.events


class _EventChecker:
    def __init__(self, counts: dict[str, int]) -> None:
        self._buffer = b""
        self._counts = counts
        self._sequence = EventSequence()

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *frames, self._buffer = self._buffer.split(b"\n\n")
        for frame in frames:
            for name, payload in events_of(frame.decode().split("\n")):
                self._sequence.add(name, payload)
                self._counts["events"] += 1

    def close(self) -> None:
        self._sequence.finish()
        self._counts["streams"] += 1


class ConformingTransport(httpx2.HTTPTransport):
    """The SDK's real HTTP transport, checking every /v1/messages body and stream event it hands the SDK."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"bodies": 0, "events": 0, "streams": 0, "errors": 0}

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        path = request.url.path
        if not path.startswith("/v1/messages"):
            return response
        if response.status_code != 200:
            check_error(orjson.loads(response.read()))
            self.counts["errors"] += 1
        elif response.headers["content-type"].startswith("text/event-stream"):
            response.stream = _CheckedStream(response.stream, _EventChecker(self.counts))  # type: ignore[arg-type]
        else:
            body = orjson.loads(response.read())
            check_count(body) if path.endswith("/count_tokens") else check_message(body)
            self.counts["bodies"] += 1
        return response


class _CheckedStream(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, checker: _EventChecker) -> None:
        self._inner = inner
        self._checker = checker
        self._complete = False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._checker.feed(chunk)
            yield chunk
        self._complete = True

    def close(self) -> None:
        self._inner.close()
        if self._complete:  # a stream the client stopped reading early is not checked for its end
            self._checker.close()

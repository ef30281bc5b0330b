"""LMDeploy's SSE streams, read into the shared events.

Framing is done here on raw body bytes rather than with a line iterator: one pass per network read, and no line
length limit (LMDeploy's final chunk can be large). Per chunk the hot path is one ``orjson.loads`` and a few dict
lookups; no pydantic, no logging.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import orjson

from backends.engine.detokenizer import byte_level_alphabet
from backends.engine.stop import StopMatcher
from backends.errors import UnavailableError, UpstreamError
from backends.interface import Delta, Finish, TokenLogprob, ToolCallDelta, TopLogprob
from backends.lmdeploy.errors import UpstreamFailure, failure_from_frame, node_failure
from backends.lmdeploy.proxy import failure_from_proxy_code

DONE = b"[DONE]"


class ByteSource(Protocol):
    async def readany(self) -> bytes: ...


MAX_EVENT_BYTES = 4 * 1024 * 1024
"""The largest SSE event the gateway reads from a node (LMDeploy's final chunk can be large, never this large)."""


class SSEReader:
    """Splits a body into the payloads of its ``data:`` lines, one per event; comments and blank events skipped.
    A line that is a JSON object outside any ``data:`` line (LMDeploy's proxy writes its errors so) is a payload
    of its own; the extra blank line the proxy writes after each event is dropped.

    The unfinished event waits in one buffer that only grows by what arrives (each byte is scanned for the event
    boundary once) and never beyond ``max_event_bytes``: a node that sends more without ending an event fails
    the request as a protocol error.
    """

    __slots__ = ("_buffer", "_carry", "_max", "_node", "_payloads", "_scanned", "_source")

    def __init__(self, source: ByteSource, *, max_event_bytes: int = MAX_EVENT_BYTES, node: str = "?") -> None:
        self._source = source
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no event boundary
        self._carry = b""  # a trailing CR, kept until the next read tells whether a LF follows it
        self._max = max_event_bytes
        self._node = node
        self._payloads: deque[bytes] = deque()

    async def next(self) -> bytes | None:
        """The next payload, or None at the end of the body."""
        payloads = self._payloads
        while not payloads:
            chunk = await self._source.readany()
            if not chunk:
                if self._carry or self._buffer.strip():
                    self._feed(b"\n\n")
                    self._buffer.clear()
                    self._scanned = 0
                    continue
                return None
            self._feed(chunk)
        return payloads.popleft()

    def ready(self) -> bytes | None:
        """The next payload if it already arrived (in the same network read as the last), else None: no read."""
        return self._payloads.popleft() if self._payloads else None

    async def drain(self) -> None:
        """Reads to the end of the body (after ``[DONE]``), so the connection can go back to the pool."""
        while await self._source.readany():
            pass

    def _feed(self, chunk: bytes) -> None:
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                self._carry = b"\r"
                chunk = chunk[:-1]
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer
        buffer += chunk
        start = 0
        search = max(self._scanned - 1, 0)  # a boundary may straddle the old end
        while (end := buffer.find(b"\n\n", search)) != -1:
            self._event(bytes(buffer[start:end]))
            start = search = end + 2
        if start:
            del buffer[:start]
        self._scanned = len(buffer)
        if len(buffer) > self._max:
            raise node_failure(
                f"LMDeploy node {self._node} sent an SSE event larger than {self._max} bytes", kind="protocol"
            )

    def _event(self, event: bytes) -> None:
        if event[:1] == b"\n":  # LMDeploy's proxy ends every event with one more blank line
            event = event.lstrip(b"\n")
        if event.startswith(b"data:") and b"\n" not in event:  # the usual case: one data line
            self._payloads.append(event[6:] if event[5:6] == b" " else event[5:])
            return
        lines = []
        unframed = []
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                lines.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line.startswith(b"{"):  # a JSON line outside SSE: how LMDeploy's proxy sends its errors
                unframed.append(line)
        if lines:
            self._payloads.append(b"\n".join(lines))
        self._payloads.extend(unframed)


def token_text(token: str, raw: Sequence[int], byte_level: bool) -> tuple[str, list[int]]:
    """LMDeploy reports vocabulary entries (``Ġworld``) with the UTF-8 bytes of that spelling; OpenAI reports the
    text (`` world``) and its bytes. Undone for byte-level BPE vocabularies; other vocabularies pass unchanged."""
    if not byte_level:
        return token, list(raw)
    decoder = byte_level_alphabet()
    try:
        data = bytes([decoder[c] for c in token])
    except KeyError:
        return token, list(raw)
    return data.decode("utf-8", errors="backslashreplace"), list(data)


def chat_logprobs(content: list[dict[str, Any]], want_top: int, byte_level: bool) -> list[TokenLogprob]:
    """LMDeploy leaves the chosen token out of ``top_logprobs``; OpenAI lists it there. Put it back, best first."""
    out = []
    for item in content:
        text, raw = token_text(item.get("token") or "", item.get("bytes") or [], byte_level)
        chosen = TopLogprob(text, raw, item.get("logprob", 0.0))
        top = [chosen]
        for alt in item.get("top_logprobs") or ():
            alt_text, alt_raw = token_text(alt.get("token") or "", alt.get("bytes") or [], byte_level)
            top.append(TopLogprob(alt_text, alt_raw, alt.get("logprob", 0.0)))
        top.sort(key=lambda t: -t.logprob)
        out.append(TokenLogprob(text, raw, chosen.logprob, top[:want_top]))
    return out


def finish_failure(reason: str, node: str) -> UpstreamFailure:
    """LMDeploy's finish reasons that OpenAI clients cannot take: the output is incomplete, so they are errors."""
    if reason == "abort":
        return UpstreamFailure(
            UnavailableError(
                f"LMDeploy node {node} aborted the request (the engine was put to sleep, stopped, or the request "
                "was aborted through /abort_request)",
                retry_after=1.0,
            ),
            retryable=True,
            node_fault=True,
            kind="abort",
        )
    if reason == "parse_error":
        return UpstreamFailure(
            UpstreamError(f"LMDeploy node {node} could not parse the model's output (finish_reason parse_error)"),
            retryable=False,
            node_fault=False,
            kind="parse_error",
        )
    return node_failure(f"LMDeploy node {node} ended the choice with finish_reason {reason!r}", kind="stream_error")


OPENAI_FINISH = frozenset({"stop", "length", "tool_calls"})


class _Parts(NamedTuple):
    """What one chunk says about its choice, before stop strings are applied."""

    text: str
    reasoning: str
    tool_calls: list[ToolCallDelta] | None
    logprobs: list[TokenLogprob] | None
    reason: str | None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _count(value: object) -> int:
    if not isinstance(value, int) or value < 0:
        raise TypeError(f"expected a token count, got {value!r}")
    return value


def _reason(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a finish reason, got {type(value).__name__}")
    return value


class ChoiceStream:
    """One upstream choice: LMDeploy chunks in, events out, with the gateway's stop strings applied.

    ``feed`` returns the events of one payload; ``finished`` tells that the choice is complete (upstream finished,
    or a stop string matched and the upstream stream must be closed).
    """

    __slots__ = (
        "byte_level",
        "cached_tokens",
        "chat",
        "completions",
        "finish_reason",
        "finished",
        "index",
        "node",
        "reasoning_tokens",
        "reported",
        "stop",
        "stopped_early",
        "tokens",
        "usage",
        "want_top",
    )

    def __init__(
        self,
        index: int,
        *,
        chat: bool,
        stops: list[str],
        want_top: int,
        byte_level: bool,
        node: str,
        completions: bool = False,
    ) -> None:
        self.index = index
        self.chat = chat
        self.completions = completions  # /v1/completions chunks (through a proxy) rather than /generate's
        self.stop = StopMatcher(stops) if stops else None
        self.want_top = want_top
        self.byte_level = byte_level
        self.node = node
        self.tokens = 0  # completion tokens seen (token ids streamed)
        self.reported = 0  # of those, the tokens the deltas so far accounted for
        self.usage: tuple[int, int] | None = None  # (prompt, completion) as LMDeploy reported them
        self.cached_tokens = 0  # of the prompt, the node's prefix-cache hits (``prompt_tokens_details``), if reported
        self.reasoning_tokens: int | None = None  # reported when the node runs a reasoning parser
        self.finish_reason: str | None = None
        self.finished = False
        self.stopped_early = False

    def feed(self, payload: bytes) -> list[Delta | Finish]:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise node_failure(
                f"LMDeploy node {self.node} sent a malformed stream chunk: {payload[:200]!r}", kind="protocol"
            ) from exc
        if not isinstance(chunk, dict):
            message = f"LMDeploy node {self.node} sent an unexpected chunk: {payload[:200]!r}"
            raise node_failure(message, kind="protocol")
        if "error" in chunk:
            raise failure_from_frame(chunk["error"], self.node)
        if "error_code" in chunk:
            raise failure_from_proxy_code(chunk["error_code"], chunk.get("text"), self.node)
        try:
            if self.chat:
                parts = self._chat(chunk)
            else:
                parts = self._completion(chunk) if self.completions else self._generate(chunk)
        except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:  # valid JSON, wrong shape
            message = f"LMDeploy node {self.node} sent a chunk of the wrong shape: {payload[:200]!r}"
            raise node_failure(message, kind="protocol") from exc
        if parts is None:
            return []
        return self._emit(*parts)

    def _chat(self, chunk: dict[str, Any]) -> _Parts | None:
        usage = chunk.get("usage")
        if usage:
            self.usage = (_count(usage.get("prompt_tokens", 0)), _count(usage.get("completion_tokens", 0)))
            prompt_details = usage.get("prompt_tokens_details")
            if prompt_details and prompt_details.get("cached_tokens") is not None:
                self.cached_tokens = _count(prompt_details["cached_tokens"])
            details = usage.get("completion_tokens_details")
            if details and details.get("reasoning_tokens") is not None:
                self.reasoning_tokens = _count(details["reasoning_tokens"])
        choices = chunk.get("choices")
        if not choices:
            return None
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or ""
        calls = delta.get("tool_calls")
        tool_calls = None
        if calls:
            tool_calls = [
                ToolCallDelta(
                    call.get("index", 0),
                    call.get("id"),
                    (call.get("function") or {}).get("name"),
                    (call.get("function") or {}).get("arguments") or "",
                )
                for call in calls
            ]
        lp = choice.get("logprobs")
        logprobs = chat_logprobs(lp["content"], self.want_top, self.byte_level) if lp and lp.get("content") else None
        ids = choice.get("output_ids")
        if ids:
            self.tokens += len(ids)
        elif logprobs:
            self.tokens += len(logprobs)
        elif text or reasoning or tool_calls:  # a node without return_token_ids: at least a token a chunk
            self.tokens += 1
        return _Parts(_text(text), _text(reasoning), tool_calls, logprobs, _reason(choice.get("finish_reason")))

    def _completion(self, chunk: dict[str, Any]) -> _Parts | None:
        usage = chunk.get("usage")
        if usage:
            self.usage = (_count(usage.get("prompt_tokens", 0)), _count(usage.get("completion_tokens", 0)))
        choices = chunk.get("choices")
        if not choices:
            return None
        choice = choices[0]
        text = _text(choice.get("text") or "")
        if text:  # no token ids in these chunks: at least a token a chunk, until the usage at the end
            self.tokens += 1
        return _Parts(text, "", None, None, _reason(choice.get("finish_reason")))

    def _generate(self, chunk: dict[str, Any]) -> _Parts:
        meta = chunk.get("meta_info") or {}
        prompt_tokens = meta.get("prompt_tokens")
        completion_tokens = meta.get("completion_tokens")
        if prompt_tokens is not None and completion_tokens is not None:
            self.usage = (_count(prompt_tokens), _count(completion_tokens))
            self.tokens = completion_tokens
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else None
        return _Parts(_text(chunk.get("text") or ""), "", None, None, _reason(reason))

    def _emit(
        self,
        text: str,
        reasoning: str,
        tool_calls: list[ToolCallDelta] | None,
        logprobs: list[TokenLogprob] | None,
        reason: str | None,
    ) -> list[Delta | Finish]:
        events: list[Delta | Finish] = []
        if self.stop is not None:
            if text:
                text, matched = self.stop.push(text)
                if matched:
                    self.stopped_early = True
                    reason = "stop"
            if reason is not None and not self.stopped_early:
                text += self.stop.flush()
        if reason is not None and reason not in OPENAI_FINISH:
            raise finish_failure(reason, self.node)
        if text or reasoning or tool_calls or logprobs:
            events.append(Delta(self.index, text, logprobs, reasoning, tool_calls, self.tokens - self.reported))
            self.reported = self.tokens
        if reason is not None:
            self.finished = True
            self.finish_reason = reason
            events.append(Finish(self.index, reason, matched_stop=self.stop.matched if self.stop is not None else None))
        return events


def coalesce(events: list[Delta | Finish], more: list[Delta | Finish]) -> list[Delta | Finish]:
    """``events`` followed by ``more``, where a text delta that ends ``events`` and one that starts ``more`` become
    one: chunks that arrived together go on as one event (a tool-call delta, or text with logprobs next to text
    without, stays apart). A delta reads as its reasoning, then its text, so content followed by reasoning (a model
    that opens ``<think>`` again) stays apart too: merged, the reasoning would jump ahead of the content."""
    if events and more:
        last, first = events[-1], more[0]
        if (
            type(last) is Delta
            and type(first) is Delta
            and last.tool_calls is None
            and first.tool_calls is None
            and (last.logprobs is None) == (first.logprobs is None)
            and not (last.text and first.reasoning)
        ):
            logprobs = None if last.logprobs is None else [*last.logprobs, *first.logprobs]  # type: ignore[misc]
            merged = Delta(
                last.index,
                last.text + first.text,
                logprobs,
                last.reasoning + first.reasoning,
                tokens=last.tokens + first.tokens,
            )
            return [*events[:-1], merged, *more[1:]]
    return events + more

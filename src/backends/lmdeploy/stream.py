"""LMDeploy's SSE streams, read into the shared events.

Framing is done here on raw body bytes rather than with a line iterator: one pass per network read, and no line
length limit (LMDeploy's final chunk can be large). Per chunk the hot path is one ``orjson.loads`` and a few dict
lookups; no pydantic, no logging.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from backends.engine.detokenizer import byte_level_alphabet
from backends.engine.stop import StopMatcher
from backends.errors import UnavailableError, UpstreamError
from backends.interface import Delta, Finish, TokenLogprob, ToolCallDelta, TopLogprob
from backends.lmdeploy.errors import UpstreamFailure, failure_from_frame, node_failure

DONE = b"[DONE]"


class ByteSource(Protocol):
    async def readany(self) -> bytes: ...


class SSEReader:
    """Splits a body into the payloads of its ``data:`` lines, one per event; comments and blank events skipped."""

    __slots__ = ("_buffer", "_payloads", "_source")

    def __init__(self, source: ByteSource) -> None:
        self._source = source
        self._buffer = b""
        self._payloads: deque[bytes] = deque()

    async def next(self) -> bytes | None:
        """The next payload, or None at the end of the body."""
        payloads = self._payloads
        while not payloads:
            chunk = await self._source.readany()
            if not chunk:
                if self._buffer.strip():
                    self._split(self._buffer + b"\n\n")
                    self._buffer = b""
                    continue
                return None
            self._split(self._buffer + chunk)
        return payloads.popleft()

    async def drain(self) -> None:
        """Reads to the end of the body (after ``[DONE]``), so the connection can go back to the pool."""
        while await self._source.readany():
            pass

    def _split(self, data: bytes) -> None:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:  # the usual case: one data line
                self._payloads.append(event[6:] if event[5:6] == b" " else event[5:])
                continue
            lines = [
                line[6:] if line[5:6] == b" " else line[5:] for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if lines:
                self._payloads.append(b"\n".join(lines))


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


class ChoiceStream:
    """One upstream choice: LMDeploy chunks in, events out, with the gateway's stop strings applied.

    ``feed`` returns the events of one payload; ``finished`` tells that the choice is complete (upstream finished,
    or a stop string matched and the upstream stream must be closed).
    """

    __slots__ = (
        "byte_level",
        "chat",
        "finish_reason",
        "finished",
        "index",
        "node",
        "reasoning_tokens",
        "stop",
        "stopped_early",
        "tokens",
        "usage",
        "want_top",
    )

    def __init__(self, index: int, *, chat: bool, stops: list[str], want_top: int, byte_level: bool, node: str) -> None:
        self.index = index
        self.chat = chat
        self.stop = StopMatcher(stops) if stops else None
        self.want_top = want_top
        self.byte_level = byte_level
        self.node = node
        self.tokens = 0  # completion tokens seen (token ids streamed)
        self.usage: tuple[int, int] | None = None  # (prompt, completion) as LMDeploy reported them
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
        if self.chat:
            return self._chat(chunk)
        return self._generate(chunk)

    def _chat(self, chunk: dict[str, Any]) -> list[Delta | Finish]:
        usage = chunk.get("usage")
        if usage:
            self.usage = (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
            details = usage.get("completion_tokens_details")
            if details and details.get("reasoning_tokens") is not None:
                self.reasoning_tokens = details["reasoning_tokens"]
        choices = chunk.get("choices")
        if not choices:
            return []
        choice = choices[0]
        ids = choice.get("output_ids")
        if ids:
            self.tokens += len(ids)
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
        return self._emit(text, reasoning, tool_calls, logprobs, choice.get("finish_reason"))

    def _generate(self, chunk: dict[str, Any]) -> list[Delta | Finish]:
        meta = chunk.get("meta_info") or {}
        prompt_tokens = meta.get("prompt_tokens")
        completion_tokens = meta.get("completion_tokens")
        if prompt_tokens is not None and completion_tokens is not None:
            self.usage = (prompt_tokens, completion_tokens)
            self.tokens = completion_tokens
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else None
        return self._emit(chunk.get("text") or "", "", None, None, reason)

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
            events.append(Delta(self.index, text, logprobs, reasoning, tool_calls))
        if reason is not None:
            self.finished = True
            self.finish_reason = reason
            events.append(Finish(self.index, reason))
        return events

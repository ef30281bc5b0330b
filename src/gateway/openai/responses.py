"""Builds OpenAI response bodies and stream frames from backend events, as plain dicts and orjson bytes.

This is the per-step hot path: one dict and one ``orjson.dumps`` per frame, no pydantic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from backends.interface import Delta, Finish, PromptEcho, PromptToken, TokenLogprob, ToolCallDelta, Usage
from gateway.errors import APIError, error_payload

DONE_FRAME = b"data: [DONE]\n\n"


def sse_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def tool_call_chunks(pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed ``tool_calls`` entries: a call's first piece has its id, type and name, later ones arguments."""
    out = []
    for piece in pieces:
        if piece.id is not None:
            out.append(
                {
                    "index": piece.index,
                    "id": piece.id,
                    "type": "function",
                    "function": {"name": piece.name or "", "arguments": piece.arguments},
                }
            )
        else:
            out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
    return out


def chat_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": e.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
        }
        for e in entries
    ]


class SSEFormat:
    """How chat and completion streams end: a failure is one ``{"error": ...}`` frame, then ``[DONE]``."""

    done_frame: bytes | None = DONE_FRAME

    def error_frame(self, error: APIError) -> bytes:
        return sse_frame(error_payload(error.message, error.type, error.param, error.code))


class ChatFormat(SSEFormat):
    """``chat.completion`` responses and ``chat.completion.chunk`` frames for one request."""

    def __init__(self, response_id: str, created: int, model: str, fingerprint: str, n: int) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        self.n = n
        self._role_sent = [False] * n
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._reasoning: list[list[str]] = [[] for _ in range(n)]
        self._calls: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[str, Any]] | None] = [None] * n
        self._finish: list[str] = ["stop"] * n

    # streaming
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        index = event.index
        if isinstance(event, Delta):
            delta: dict[str, Any] = {"content": event.text}
            if not self._role_sent[index]:
                self._role_sent[index] = True
                delta = {"role": "assistant", "content": event.text}
            if event.reasoning:
                delta["reasoning_content"] = event.reasoning
                if not event.text:
                    delta["content"] = None
            if event.tool_calls:
                delta["tool_calls"] = tool_call_chunks(event.tool_calls)
                if not event.text:
                    delta["content"] = None
            logprobs = {"content": chat_logprobs(event.logprobs), "refusal": None} if event.logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            return sse_frame(self._chunk([choice]))
        if isinstance(event, Finish):
            delta = {} if self._role_sent[index] else {"role": "assistant", "content": ""}
            self._role_sent[index] = True
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": event.reason}
            return sse_frame(self._chunk([choice]))
        return None

    def usage_frame(self, usage: Usage) -> bytes:
        payload = self._chunk([])
        payload["usage"] = usage_dict(usage)
        return sse_frame(payload)

    # whole response
    def add(self, event: Delta | Finish | PromptEcho) -> None:
        if isinstance(event, Delta):
            self._texts[event.index].append(event.text)
            if event.reasoning:
                self._reasoning[event.index].append(event.reasoning)
            if event.tool_calls:
                calls = self._calls[event.index]
                for piece in event.tool_calls:  # pieces of one call share its index; the first names it
                    if piece.index >= len(calls):
                        function = {"name": piece.name or "", "arguments": piece.arguments}
                        calls.append({"id": piece.id or "", "type": "function", "function": function})
                    else:
                        calls[piece.index]["function"]["arguments"] += piece.arguments
            if event.logprobs:
                collected = self._logprobs[event.index]
                if collected is None:
                    collected = self._logprobs[event.index] = []
                collected.extend(chat_logprobs(event.logprobs))
        elif isinstance(event, Finish):
            self._finish[event.index] = event.reason

    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]:
        choices = []
        for i in range(self.n):
            logprobs = None
            if want_logprobs:
                logprobs = {"content": self._logprobs[i] or [], "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": "".join(self._texts[i]), "refusal": None}
            if self._reasoning[i]:
                message["reasoning_content"] = "".join(self._reasoning[i])
            if self._calls[i]:
                message["tool_calls"] = self._calls[i]
                message["content"] = message["content"] or None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": self._finish[i]})
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage_dict(usage)
        return body


class CompletionFormat(SSEFormat):
    """``text_completion`` responses and frames; choice indexes are ``prompt_index * n + i``."""

    def __init__(self, response_id: str, created: int, model: str, fingerprint: str, choices: int) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        self.choices = choices
        self._texts: list[list[str]] = [[] for _ in range(choices)]
        self._offsets = [0] * choices
        self._logprobs: list[dict[str, list[Any]] | None] = [None] * choices
        self._finish: list[str] = ["stop"] * choices

    @staticmethod
    def _logprob_block(
        text_start: int, entries: Sequence[TokenLogprob], *, advance: bool = True
    ) -> dict[str, list[Any]]:
        """Legacy logprobs: ``top_logprobs`` always hold the chosen token (up to ``logprobs + 1`` entries)."""
        offsets = []
        tops = []
        offset = text_start
        for e in entries:
            offsets.append(offset)
            if advance:
                offset += len(e.token)
            top = {t.token: t.logprob for t in e.top}
            top.setdefault(e.token, e.logprob)
            tops.append(top)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    @staticmethod
    def _prompt_block(text_start: int, entries: Sequence[PromptToken]) -> dict[str, list[Any]]:
        """The echoed prompt's logprobs: null for the first token; the engine gives no alternatives for the rest."""
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {e.token: e.logprob} for e in entries],
            "text_offset": [text_start + e.offset for e in entries],
        }

    def _event_block(self, event: Delta | Finish | PromptEcho) -> dict[str, list[Any]] | None:
        """The logprob block an event adds to its choice, at the choice's current text offset."""
        start = self._offsets[event.index]
        if isinstance(event, PromptEcho):
            return self._prompt_block(start, event.logprobs) if event.logprobs is not None else None
        if isinstance(event, Finish):  # the EOS: listed, but it adds no text
            return self._logprob_block(start, event.logprobs, advance=False) if event.logprobs else None
        return self._logprob_block(start, event.logprobs) if event.logprobs else None

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        }

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        index = event.index
        logprobs = self._event_block(event)
        if isinstance(event, Delta | PromptEcho):
            self._offsets[index] += len(event.text)
            choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None}
            return sse_frame(self._chunk(choice))
        if isinstance(event, Finish):
            choice = {"index": index, "text": "", "logprobs": logprobs, "finish_reason": event.reason}
            return sse_frame(self._chunk(choice))
        return None

    def usage_frame(self, usage: Usage) -> bytes:
        payload = self._chunk({})
        payload["choices"] = []
        payload["usage"] = usage_dict(usage)
        return sse_frame(payload)

    def add(self, event: Delta | Finish | PromptEcho) -> None:
        index = event.index
        block = self._event_block(event)
        if block is not None:
            collected = self._logprobs[index]
            if collected is None:
                self._logprobs[index] = block
            else:
                for key, values in block.items():
                    collected[key].extend(values)
        if isinstance(event, Delta | PromptEcho):
            self._texts[index].append(event.text)
            self._offsets[index] += len(event.text)
        elif isinstance(event, Finish):
            self._finish[index] = event.reason

    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]:
        empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        choices = [
            {
                "index": i,
                "text": "".join(self._texts[i]),
                "logprobs": (self._logprobs[i] or empty) if want_logprobs else None,
                "finish_reason": self._finish[i],
            }
            for i in range(self.choices)
        ]
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage_dict(usage)
        return body

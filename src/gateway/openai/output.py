"""Builds OpenAI response bodies and stream frames from backend events, as plain dicts and orjson bytes.

This is the per-step hot path, no pydantic. The fields every frame of a response repeats (id, object, created,
model, system fingerprint) are rendered once into a byte prefix; a plain text delta (the usual frame) is that
prefix, the choice index and one ``orjson.dumps`` of its text. Other frames render their choices as a dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from backends.interface import Delta, Finish, PromptEcho, PromptToken, TokenLogprob, ToolCallDelta, Usage
from gateway.errors import APIError, error_payload
from gateway.sse import PING_FRAME

DONE_FRAME = b"data: [DONE]\n\n"


def sse_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage with DeepSeek's cache fields (hits plus misses make the prompt tokens)."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_tokens,
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
    """How chat and completion streams end: the usage chunk (when asked for) and ``[DONE]``; a failure is one
    ``{"error": ...}`` frame, then ``[DONE]``."""

    done_frame: bytes | None = DONE_FRAME
    ping_frame = PING_FRAME

    def usage_frame(self, usage: Usage) -> bytes:
        raise NotImplementedError

    def end_frames(self, usage: Usage | None, include_usage: bool) -> bytes:
        if include_usage and usage is not None:
            return self.usage_frame(usage) + DONE_FRAME
        return DONE_FRAME

    def error_frame(self, error: APIError) -> bytes:
        return sse_frame(error_payload(error.message, error.type, error.param, error.code))


class _FramePrefix:
    """The bytes a response's stream frames start with, up to ``"choices":``; rebuilt when the fingerprint changes
    (a fallback target took the request over before its first frame)."""

    __slots__ = ("_fingerprint", "_object", "choices", "created", "id", "model", "service_tier", "texts")

    def __init__(self, response_id: str, created: int, model: str, fingerprint: str, obj: str, tier: str) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self._object = obj
        self.service_tier = tier
        self.fingerprint = fingerprint

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        self._fingerprint = value
        head = orjson.dumps(
            {
                "id": self.id,
                "object": self._object,
                "created": self.created,
                "model": self.model,
                "service_tier": self.service_tier,
                "system_fingerprint": value,
            }
        )
        self.choices = b"data: " + head[:-1] + b',"choices":'
        self.texts: dict[int, bytes] = {}  # choice index -> the prefix of its plain text deltas

    def text_head(self, index: int, text_key: bytes) -> bytes:
        head = self.texts.get(index)
        if head is None:
            head = self.texts[index] = self.choices + b'[{"index":%d,%s:' % (index, text_key)
        return head


_CHAT_TEXT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'
_COMPLETION_TEXT_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


class ChatFormat(SSEFormat):
    """``chat.completion`` responses and ``chat.completion.chunk`` frames for one request."""

    def __init__(
        self, response_id: str, created: int, model: str, fingerprint: str, n: int, service_tier: str = "default"
    ) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.service_tier = service_tier  # the tier that served the request, echoed in every body and chunk
        self._prefix = _FramePrefix(response_id, created, model, fingerprint, "chat.completion.chunk", service_tier)
        self.n = n
        self._role_sent = [False] * n
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._reasoning: list[list[str]] = [[] for _ in range(n)]
        self._calls: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[str, Any]] | None] = [None] * n
        self._finish: list[str] = ["stop"] * n

    @property
    def fingerprint(self) -> str:
        return self._prefix.fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        self._prefix.fingerprint = value

    # streaming
    def _frame(self, choices: list[dict[str, Any]]) -> bytes:
        return self._prefix.choices + orjson.dumps(choices) + b"}\n\n"

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        index = event.index
        if isinstance(event, Delta):
            if not (event.reasoning or event.tool_calls or event.logprobs) and self._role_sent[index]:
                return self._prefix.text_head(index, b'"delta":{"content"') + orjson.dumps(event.text) + _CHAT_TEXT_TAIL
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
            return self._frame([choice])
        if isinstance(event, Finish):
            delta = {} if self._role_sent[index] else {"role": "assistant", "content": ""}
            self._role_sent[index] = True
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": event.reason}
            return self._frame([choice])
        return None

    def usage_frame(self, usage: Usage) -> bytes:
        return self._prefix.choices + b'[],"usage":' + orjson.dumps(usage_dict(usage)) + b"}\n\n"

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
            "service_tier": self.service_tier,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage_dict(usage)
        return body


class CompletionFormat(SSEFormat):
    """``text_completion`` responses and frames; choice indexes are ``prompt_index * n + i``."""

    def __init__(
        self, response_id: str, created: int, model: str, fingerprint: str, choices: int, service_tier: str = "default"
    ) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.service_tier = service_tier  # the tier that served the request, echoed in every body and chunk
        self._prefix = _FramePrefix(response_id, created, model, fingerprint, "text_completion", service_tier)
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

    @property
    def fingerprint(self) -> str:
        return self._prefix.fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        self._prefix.fingerprint = value

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        index = event.index
        if type(event) is Delta and not event.logprobs:
            self._offsets[index] += len(event.text)
            return self._prefix.text_head(index, b'"text"') + orjson.dumps(event.text) + _COMPLETION_TEXT_TAIL
        logprobs = self._event_block(event)
        if isinstance(event, Delta | PromptEcho):
            self._offsets[index] += len(event.text)
            choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None}
        elif isinstance(event, Finish):
            choice = {"index": index, "text": "", "logprobs": logprobs, "finish_reason": event.reason}
        else:
            return None
        return self._prefix.choices + orjson.dumps([choice]) + b"}\n\n"

    def usage_frame(self, usage: Usage) -> bytes:
        return self._prefix.choices + b'[],"usage":' + orjson.dumps(usage_dict(usage)) + b"}\n\n"

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
        empty: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
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
            "service_tier": self.service_tier,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage_dict(usage)
        return body

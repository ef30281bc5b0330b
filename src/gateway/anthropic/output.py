"""Backend events as Anthropic messages and stream events.

One ``MessagesFormat`` per request turns its events into content blocks: DeepSeek's reasoning as a ``thinking``
block (with its signature), text as a ``text`` block, each tool call as a ``tool_use`` block, in the order the
model wrote them. As a stream: ``message_start`` with the first output, then per block ``content_block_start``,
its deltas (``thinking_delta`` and a closing ``signature_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``, and last ``message_delta`` (stop reason, usage) and ``message_stop``. A failure after the
first event is an ``error`` event that ends the stream; a silent stream gets ``ping`` events.

The usual frame, a text delta, is a pre-rendered byte prefix and one ``orjson.dumps`` of its text, as on the chat
path.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

from backends.interface import Delta, Finish, PromptEcho, ToolCallDelta, Usage
from gateway.anthropic.errors import error_object
from gateway.anthropic.signatures import ThinkingSigner
from gateway.errors import APIError

PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'
Frames = list[bytes] | None  # where stream events go; None when building a whole message


def new_id(prefix: str) -> str:
    """Anthropic-style ids: ``msg_...``, ``toolu_...`` (24 hex digits of randomness)."""
    return f"{prefix}_{os.urandom(12).hex()}"


def _event(kind: bytes, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the ``input`` object of its ``tool_use`` block."""
    if not arguments:
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"arguments": arguments}  # not JSON (an upstream's parser let it through): kept, not lost
    return value if isinstance(value, dict) else {"arguments": value}


ANTHROPIC_TIERS = {"priority": "priority", "batch": "batch"}
"""How Anthropic's usage names the tier a message was served in; every other tier is its ``standard``."""


class MessagesFormat:
    """The content blocks and stream events of one message (the format protocol of ``gateway.streaming``)."""

    ping_frame = PING_FRAME

    def __init__(
        self,
        message_id: str,
        model: str,
        *,
        max_tokens: int,
        signer: ThinkingSigner,
        omit_thinking: bool = False,
        service_tier: str = "default",
    ) -> None:
        self.fingerprint = ""  # set by the router's fallback hook; messages do not report it
        self._service_tier = ANTHROPIC_TIERS.get(service_tier, "standard")  # echoed in every usage object
        self._id = message_id
        self._model = model
        self._max_tokens = max_tokens
        self._signer = signer
        self._omit_thinking = omit_thinking  # thinking.display "omitted": blocks carry only their signature
        self._started = False
        self._blocks: list[dict[str, Any]] = []  # the message's content, the open block last
        self._open: str | None = None  # type of the block taking deltas
        self._pieces: list[str] = []  # the open block's text (or a tool call's arguments) so far
        self._call_index = -1  # the backend's index of the call the open tool_use block holds
        self._text_head = b""  # the bytes every text delta of the open block starts with
        self._finish: Finish | None = None

    # ---- events ----------------------------------------------------------------------------------------------

    def _start(self, frames: Frames) -> None:
        if self._started:
            return
        self._started = True
        if frames is not None:
            # The counts come with message_delta (cumulative, as Anthropic's): prompt tokens are known at the end.
            message = self._envelope([], None, None, self._usage(None))
            frames.append(_event(b"message_start", {"type": "message_start", "message": message}))

    def _open_block(self, frames: Frames, block: dict[str, Any]) -> None:
        self._close(frames)
        self._blocks.append(block)
        self._open = block["type"]
        self._pieces = []
        if frames is not None:
            index = len(self._blocks) - 1
            start = {"type": "content_block_start", "index": index, "content_block": block}
            frames.append(_event(b"content_block_start", start))
            self._text_head = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,"delta":{"type":"%s",'
                % (index, b"thinking_delta" if block["type"] == "thinking" else b"text_delta")
            )

    def _text(self, frames: Frames, kind: str, text: str) -> None:
        if self._open != kind:
            if kind == "thinking":
                self._open_block(frames, {"type": "thinking", "thinking": "", "signature": ""})
            else:
                self._open_block(frames, {"type": "text", "text": ""})
        self._pieces.append(text)
        if frames is not None and not (kind == "thinking" and self._omit_thinking):
            key = b'"thinking":' if kind == "thinking" else b'"text":'
            frames.append(self._text_head + key + orjson.dumps(text) + b"}}\n\n")

    def _call_piece(self, frames: Frames, piece: ToolCallDelta) -> None:
        if piece.id is not None or self._open != "tool_use" or piece.index != self._call_index:
            self._open_block(frames, {"type": "tool_use", "id": new_id("toolu"), "name": piece.name or "", "input": {}})
            self._call_index = piece.index
        if piece.arguments:
            self._pieces.append(piece.arguments)
            if frames is not None:
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                event = {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}
                frames.append(_event(b"content_block_delta", event))

    def _close(self, frames: Frames) -> None:
        """Ends the open block: its whole text (or input) goes into the message, a thinking block gets its
        signature."""
        kind = self._open
        if kind is None:
            return
        self._open = None
        block = self._blocks[-1]
        index = len(self._blocks) - 1
        joined = "".join(self._pieces)
        if kind == "thinking":
            block["signature"] = self._signer.sign(joined, embed=self._omit_thinking)
            block["thinking"] = "" if self._omit_thinking else joined
            if frames is not None:
                delta = {"type": "signature_delta", "signature": block["signature"]}
                frames.append(
                    _event(b"content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                )
        elif kind == "text":
            block["text"] = joined
        else:
            block["input"] = _tool_input(joined)
        if frames is not None:
            frames.append(_event(b"content_block_stop", {"type": "content_block_stop", "index": index}))

    def _apply(self, event: Delta | Finish | PromptEcho, frames: Frames) -> None:
        self._start(frames)
        if isinstance(event, Delta):
            if event.reasoning:
                self._text(frames, "thinking", event.reasoning)
            if event.text:
                self._text(frames, "text", event.text)
            for piece in event.tool_calls or ():
                self._call_piece(frames, piece)
        elif isinstance(event, Finish):
            self._finish = event
            self._close(frames)

    # ---- the message -----------------------------------------------------------------------------------------

    def _stop(self, usage: Usage | None) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``)."""
        finish = self._finish
        if finish is None:
            return "end_turn", None
        if finish.reason == "length":
            # The output was cut to the context left by the prompt before reaching max_tokens.
            if usage is not None and usage.completion_tokens < self._max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if finish.matched_stop is not None:
            return "stop_sequence", finish.matched_stop
        if finish.reason == "tool_calls" or any(b["type"] == "tool_use" for b in self._blocks):
            return "tool_use", None
        return "end_turn", None

    def _usage(self, usage: Usage | None) -> dict[str, Any]:
        """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache, as Anthropic counts
        them, beside DeepSeek's hit and miss fields (which make the whole prompt)."""
        prompt, cached = (usage.prompt_tokens, usage.cached_tokens) if usage is not None else (0, 0)
        body: dict[str, Any] = {
            "input_tokens": prompt - cached,
            "output_tokens": usage.completion_tokens if usage is not None else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "prompt_cache_hit_tokens": cached,
            "prompt_cache_miss_tokens": prompt - cached,
        }
        if usage is not None and usage.reasoning_tokens is not None:
            body["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
        return body

    def _envelope(
        self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {**usage, "service_tier": self._service_tier},  # message_delta's usage has no tier
        }

    def _end_frames(self, usage: Usage | None) -> bytes:
        stop_reason, stop_sequence = self._stop(usage)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self._usage(usage),
        }
        return _event(b"message_delta", delta) + _event(b"message_stop", {"type": "message_stop"})

    # ---- the format protocol of gateway.streaming ------------------------------------------------------------

    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        frames: list[bytes] = []
        self._apply(event, frames)
        return b"".join(frames) if frames else None

    def add(self, event: Delta | Finish | PromptEcho) -> None:
        self._apply(event, None)

    def end_frames(self, usage: Usage | None, include_usage: bool) -> bytes:
        """The end of a stream that ended well: its open block closes, then ``message_delta`` (with the usage, zero
        when the backend reported none) and ``message_stop``. A Messages stream always carries its usage."""
        frames: list[bytes] = []
        self._start(frames)
        self._close(frames)
        return b"".join(frames) + self._end_frames(usage)

    done_frame: bytes | None = None  # after an error event nothing follows: Anthropic's error event ends the stream

    def error_frame(self, error: APIError) -> bytes:
        """A failure after the stream started: Anthropic's ``error`` event, which ends the stream."""
        return _event(b"error", error_object(error.status, error.message))

    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]:
        self._close(None)
        stop_reason, stop_sequence = self._stop(usage)
        return self._envelope(self._blocks, stop_reason, stop_sequence, self._usage(usage))

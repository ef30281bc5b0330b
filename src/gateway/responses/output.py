"""Backend events as Responses API output: ``response`` objects and their stream events.

One ``ResponsesFormat`` per request turns the events of its one choice into output items (a ``reasoning``
item for DeepSeek's thinking, a ``message`` with ``output_text``, one ``function_call`` per tool call), either
as a whole response or as OpenAI's event sequence: ``response.created``, ``response.in_progress``, then per item
``output_item.added``, ``content_part.added``, deltas, ``*.done`` events, ``output_item.done``, and last
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``; ``response.failed`` when it
fails), each with its ``sequence_number``. A stream always ends with one of the three, with its usage or, when the
backend reported none, ``usage: null``. Plain dicts and orjson, as on the chat path.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import orjson

from backends.interface import Delta, Finish, PromptEcho, ToolCallDelta, Usage
from gateway.errors import APIError
from gateway.openai.output import chat_logprobs
from gateway.responses.protocol import CreateResponseRequest, new_id
from gateway.sse import PING_FRAME

Frames = list[bytes] | None  # where stream events go; None when building a whole response


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_tokens,
    }


def response_envelope(
    body: CreateResponseRequest, model: str, response_id: str, created_at: int, service_tier: str = "default"
) -> dict[str, Any]:
    """The ``response`` object before any output: the request's settings as the response reports them, with the
    served model's name (``body.model`` may be an alias of it) and the service tier that serves it."""
    text_format = body.text.format.echo() if body.text is not None and body.text.format is not None else None
    reasoning = body.reasoning
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning is not None else None,
            "summary": reasoning.summary if reasoning is not None else None,
        },
        "service_tier": service_tier,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": text_format or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": body.tool_choice or "auto",
        "tools": [
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
            for tool in body.tools or ()
        ],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


class ResponsesFormat:
    """Output items and stream events of one response (``n`` is always 1).

    Implements the format protocol of ``gateway.streaming``. ``final`` is the finished response body, once
    ``end_frames`` or ``response`` built it (what the route stores).
    """

    done_frame: bytes | None = None  # a Responses stream ends with its terminal event, not [DONE]
    ping_frame = PING_FRAME

    def __init__(self, envelope: dict[str, Any], *, want_logprobs: bool = False) -> None:
        self.fingerprint = ""  # set by the router's fallback hook; the Responses API does not report it
        self._envelope = envelope
        self._want_logprobs = want_logprobs
        self.final: dict[str, Any] | None = None
        self._sequence = 0
        self._started = False
        self._output: list[dict[str, Any]] = []  # items in output order, open ones included
        self._open: dict[str, Any] | None = None  # the reasoning or message item taking text deltas
        self._open_text: list[str] = []
        self._open_logprobs: list[dict[str, Any]] = []
        self._call: dict[str, Any] | None = None  # the function_call item taking argument deltas
        self._call_index = -1
        self._call_arguments: list[str] = []
        self._finish = "stop"

    # events
    def _emit(self, frames: Frames, kind: str, fields: dict[str, Any]) -> None:
        if frames is None:
            return
        fields["type"] = kind
        fields["sequence_number"] = self._sequence
        self._sequence += 1
        frames.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(fields) + b"\n\n")

    def _start(self, frames: Frames) -> None:
        if self._started:
            return
        self._started = True
        snapshot = dict(self._envelope)
        self._emit(frames, "response.created", {"response": snapshot})
        self._emit(frames, "response.in_progress", {"response": snapshot})

    def _open_item(self, frames: Frames, item: dict[str, Any]) -> int:
        index = len(self._output)
        self._output.append(item)
        self._emit(frames, "response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)})
        return index

    def _text(self, frames: Frames, kind: str, text: str, logprobs: list[dict[str, Any]] | None) -> None:
        """Appends text to the open item of ``kind`` (``reasoning`` or ``message``), opening it if needed."""
        item = self._open
        if item is None or item["type"] != kind:
            self._close_open(frames)
            self._close_call(frames)
            if kind == "reasoning":
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress"}
                item["content"] = []
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            index = self._open_item(frames, item)
            self._emit(
                frames,
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
            self._open = item
            self._open_text = []
            self._open_logprobs = []
        self._open_text.append(text)
        if logprobs:
            self._open_logprobs.extend(logprobs)
        if frames is not None:
            fields: dict[str, Any] = {
                "item_id": item["id"],
                "output_index": len(self._output) - 1,
                "content_index": 0,
                "delta": text,
            }
            if kind == "message":
                fields["logprobs"] = logprobs or []
                self._emit(frames, "response.output_text.delta", fields)
            else:
                self._emit(frames, "response.reasoning_text.delta", fields)

    def _close_open(self, frames: Frames) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        index = self._output.index(item)
        text = "".join(self._open_text)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            self._emit(frames, "response.reasoning_text.done", {**ids, "text": text})
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._open_logprobs}
            self._emit(frames, "response.output_text.done", {**ids, "text": text, "logprobs": self._open_logprobs})
        self._emit(frames, "response.content_part.done", {**ids, "part": part})
        item["content"] = [part]
        item["status"] = "incomplete" if self._finish == "length" and item["type"] == "message" else "completed"
        self._emit(frames, "response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)})

    def _call_piece(self, frames: Frames, piece: ToolCallDelta) -> None:
        if piece.id is not None or self._call is None or piece.index != self._call_index:
            self._close_open(frames)
            self._close_call(frames)
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": piece.id or new_id("call"),
                "name": piece.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self._open_item(frames, item)
            self._call = item
            self._call_index = piece.index
            self._call_arguments = []
        if piece.arguments:
            self._call_arguments.append(piece.arguments)
            fields = {"item_id": self._call["id"], "output_index": len(self._output) - 1, "delta": piece.arguments}
            self._emit(frames, "response.function_call_arguments.delta", fields)

    def _close_call(self, frames: Frames) -> None:
        item = self._call
        if item is None:
            return
        self._call = None
        index = self._output.index(item)
        item["arguments"] = "".join(self._call_arguments)
        item["status"] = "completed"
        self._emit(
            frames,
            "response.function_call_arguments.done",
            {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
        )
        self._emit(frames, "response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)})

    def _apply(self, event: Delta | Finish | PromptEcho, frames: Frames) -> None:
        self._start(frames)
        if isinstance(event, Delta):
            if event.reasoning:
                self._text(frames, "reasoning", event.reasoning, None)
            if event.text:
                logprobs = chat_logprobs(event.logprobs) if self._want_logprobs and event.logprobs else None
                self._text(frames, "message", event.text, logprobs)
            for piece in event.tool_calls or ():
                self._call_piece(frames, piece)
        elif isinstance(event, Finish):
            self._finish = event.reason
            if not self._output:  # nothing was generated: the answer is an empty message
                self._text(frames, "message", "", None)
            self._close_open(frames)
            self._close_call(frames)

    # the format protocol of gateway.streaming
    def frame(self, event: Delta | Finish | PromptEcho) -> bytes | None:
        frames: list[bytes] = []
        self._apply(event, frames)
        return b"".join(frames) if frames else None

    def add(self, event: Delta | Finish | PromptEcho) -> None:
        self._apply(event, None)

    def end_frames(self, usage: Usage | None, include_usage: bool) -> bytes:
        """The terminal event of a stream that ended well: ``response.completed`` or ``response.incomplete``, with
        the usage if the backend reported it (``usage: null`` if not: a stream cut at a stop string by the gateway
        may end without one). The Responses API always reports usage, whatever ``include_usage`` says."""
        body = self.response(usage, self._want_logprobs)
        frames: list[bytes] = []
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        self._emit(frames, kind, {"response": body})
        return b"".join(frames)

    def response(self, usage: Usage | None, want_logprobs: bool) -> dict[str, Any]:
        """The final response body (kept as ``final``)."""
        self._close_open(None)
        self._close_call(None)
        body = dict(self._envelope)
        incomplete = self._finish == "length"
        body["status"] = "incomplete" if incomplete else "completed"
        body["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        body["completed_at"] = None if incomplete else int(time.time())
        body["output"] = self._output
        body["usage"] = usage_body(usage) if usage is not None else None
        self.final = body
        return body

    def _output_so_far(self) -> list[dict[str, Any]]:
        """The output items as they stand, the unfinished ones with their text so far, marked incomplete."""
        output = copy.deepcopy(self._output)
        for position, item in enumerate(self._output):
            if item is self._open:
                text = "".join(self._open_text)
                if item["type"] == "reasoning":
                    part: dict[str, Any] = {"type": "reasoning_text", "text": text}
                else:
                    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._open_logprobs}
                output[position].update(content=[part], status="incomplete")
            elif item is self._call:
                output[position].update(arguments="".join(self._call_arguments), status="incomplete")
        return output

    def error_frame(self, error: APIError) -> bytes:
        """A failure after the stream started: ``response.failed`` with what was generated so far."""
        body = dict(self._envelope)
        body["status"] = "failed"
        body["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        body["output"] = self._output_so_far()
        frames: list[bytes] = []
        self._emit(frames, "response.failed", {"response": body})
        return b"".join(frames)

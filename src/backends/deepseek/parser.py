"""Streaming parser for DeepSeek V4.1 completions: ``<think>`` reasoning and DSML tool calls (format spec H8).

The engine hands text over one step at a time, split anywhere, including inside a tag. This state machine turns
each piece into three channels (reasoning, content, tool calls) so that the concatenated result never depends on
how the text was split. It holds back only what might still be a tag: the tail from the last ``<`` while that
tail is a prefix of a tag it is looking for, the name of a call until ``">``, and a call's parameters until
``</｜DSML｜ invoke>``.

Tool calls come out as OpenAI-shaped pieces: a call's id and name as soon as its name is complete (arguments
``""``), then its whole JSON arguments when the invoke closes (in one piece when both land in the same push).
Building the arguments at the end of the invoke lets the unwrap rule and the string/JSON typing see every
parameter, and costs nothing per token.

States: CONTENT, REASONING, CALLS (once a call block or a call has begun, between invokes), NAME, ARGS.

- CONTENT: ``<think>`` -> REASONING; a bare ``</think>`` is dropped; ``<｜DSML｜ calls>`` -> CALLS; an
  ``<｜DSML｜ invoke name="`` without the calls wrapper -> NAME (it is a call, as in DeepSeek's parser).
- REASONING: ``<think>`` is dropped; ``</think>`` -> CONTENT; ``<｜DSML｜ calls>`` -> CALLS (ends reasoning).
- CALLS: ``<｜DSML｜ invoke name="`` -> NAME; anything else, ``</｜DSML｜ calls>`` and text after it included, is
  dropped: the calls end the turn (V4.1 writes EOS there; DeepSeek's parser rejects text after the block).
- NAME: ``">`` -> ARGS (the call starts; its name is stripped, and a call with an empty name is dropped).
- ARGS: ``</｜DSML｜ invoke>`` or ``</｜DSML｜ calls>`` -> CALLS.

With tool parsing on, content that is only whitespace is held until something else arrives: if a tool call comes
first it is dropped (chat-mode calls start with ``\\n\\n<｜DSML｜ calls>``), so such a message has no content.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from backends.deepseek.arguments import arguments_json
from backends.deepseek.markers import (
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    THINK_END,
    THINK_START,
)
from backends.interface import ToolCallDelta

_CONTENT, _REASONING, _CALLS, _NAME, _ARGS = range(5)

_NAME_END = '">'
_CALL_OPENINGS = (DSML_CALLS_START, DSML_INVOKE_START)


class ParsedText(NamedTuple):
    """What one piece of completion text contributed to each channel."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCallDelta, ...]


NOTHING = ParsedText("", "", ())


def new_tool_call_id() -> str:
    """OpenAI-style call id (``call_`` and 24 hex digits), unique per call."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Each declared tool's ``parameters`` schema by name, from an OpenAI tools list (to type the arguments)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        out[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return out


class DeepSeekV41OutputParser:
    """Splits one choice's completion text into reasoning, content and tool calls, for any chunking.

    ``in_reasoning``: the prompt ends inside ``<think>`` (see ``encoding.prompt_ends_in_thinking``).
    ``tools``: each declared tool's parameter schema (``tool_schemas``); ``None`` turns tool parsing off (DSML
    then stays content).
    ``max_calls``: calls past this many are parsed but not emitted (``parallel_tool_calls: false``).
    ``literal_content``: once in content, every character is content (no tags): for replies whose answer is
    constrained to a format, where a ``<think>`` inside a JSON string is data, not markup.
    """

    __slots__ = (
        "_buf",
        "_call_emitted",
        "_content_started",
        "_content_tags",
        "_emitted_calls",
        "_literal",
        "_max_calls",
        "_name",
        "_new_id",
        "_num_calls",
        "_out_calls",
        "_out_content",
        "_out_reasoning",
        "_pending_ws",
        "_reasoning_tags",
        "_scan_from",
        "_state",
        "_tools",
    )

    def __init__(
        self,
        *,
        in_reasoning: bool,
        tools: Mapping[str, Mapping[str, Any]] | None = None,
        max_calls: int | None = None,
        literal_content: bool = False,
        new_id: Callable[[], str] = new_tool_call_id,
    ) -> None:
        self._state = _REASONING if in_reasoning else _CONTENT
        self._tools = tools
        self._reasoning_tags: tuple[str, ...] = (
            (THINK_START, THINK_END, DSML_CALLS_START) if tools is not None else (THINK_START, THINK_END)
        )
        self._content_tags = (*self._reasoning_tags, DSML_INVOKE_START) if tools is not None else self._reasoning_tags
        self._max_calls = max_calls
        self._literal = literal_content and tools is None
        self._new_id = new_id
        self._buf = ""
        self._scan_from = 0
        self._name = ""
        self._num_calls = 0  # calls started, emitted or not
        self._emitted_calls = 0
        self._call_emitted = False  # whether the call being parsed is emitted
        self._content_started = tools is None  # without tool parsing, content is never held back
        self._pending_ws = ""
        self._out_reasoning: list[str] = []
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    @property
    def called(self) -> bool:
        """Whether at least one tool call was emitted (the choice then finishes with ``tool_calls``)."""
        return self._emitted_calls > 0

    def push(self, text: str) -> ParsedText:
        """Feed the next piece of text; returns what can be emitted now."""
        if not text:
            return NOTHING
        state = self._state
        if not self._buf and "<" not in text:  # fast path: no tag can start in this piece
            if state == _REASONING:
                return ParsedText(text, "", ())
            if state == _CONTENT and self._content_started:
                return ParsedText("", text, ())
        if state == _CONTENT and self._literal:
            return ParsedText("", text, ())
        self._buf += text
        self._scan()
        return self._take()

    def finish(self) -> ParsedText:
        """End of the completion: release held text and close an unterminated call with the parameters it
        completed (an unfinished value, cut by ``max_tokens``, is left out rather than handed over half-written;
        so is the start of a call block, ``<｜DSML…``, cut before its tag was complete)."""
        state, buf = self._state, self._buf
        self._buf = ""
        if state in (_CONTENT, _REASONING) and len(buf) > 1 and any(tag.startswith(buf) for tag in _CALL_OPENINGS):
            buf = ""  # a call block (or call) cut short after its first characters: markup, not text
        if state == _CONTENT:
            self._content(buf)
        elif state == _REASONING:
            if buf:
                self._out_reasoning.append(buf)
        elif state == _ARGS:
            self._end_call(buf)
        # CALLS: whitespace between invokes; NAME: a call whose name never finished, nothing of it was sent.
        self._state = _CONTENT
        if self._pending_ws and not self._num_calls:
            self._out_content.append(self._pending_ws)
        self._pending_ws = ""
        return self._take()

    # ---- internals ------------------------------------------------------------------------------------------

    def _take(self) -> ParsedText:
        reasoning = "".join(self._out_reasoning)
        content = "".join(self._out_content)
        calls = tuple(self._out_calls)
        self._out_reasoning.clear()
        self._out_content.clear()
        self._out_calls.clear()
        if not reasoning and not content and not calls:
            return NOTHING
        return ParsedText(reasoning, content, calls)

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._content_started:
            self._out_content.append(text)
        elif text.isspace():
            self._pending_ws += text
        else:
            self._out_content.append(self._pending_ws + text)
            self._pending_ws = ""
            self._content_started = True

    def _scan(self) -> None:
        while True:
            state = self._state
            buf = self._buf
            if state == _CONTENT and self._literal:
                self._emit_text(buf)
                self._buf = ""
                return
            if state in (_CONTENT, _REASONING):
                tags = self._content_tags if state == _CONTENT else self._reasoning_tags
                at, tag = _earliest(buf, tags)
                if tag is None:
                    keep = _partial_tag_start(buf, tags)
                    self._emit_text(buf[:keep])
                    self._buf = buf[keep:]
                    return
                self._emit_text(buf[:at])
                self._buf = buf[at + len(tag) :]
                if tag == THINK_START:
                    self._state = _REASONING
                elif tag == THINK_END:
                    self._state = _CONTENT
                else:  # a DSML calls block, or a call written without it
                    self._state = _CALLS if tag == DSML_CALLS_START else _NAME
                    if not self._content_started:
                        self._pending_ws = ""
            elif state == _CALLS:
                at = buf.find(DSML_INVOKE_START)
                if at < 0:
                    self._buf = buf[_partial_tag_start(buf, (DSML_INVOKE_START,)) :]
                    return
                self._buf = buf[at + len(DSML_INVOKE_START) :]
                self._state = _NAME
            elif state == _NAME:
                at = buf.find(_NAME_END)
                if at < 0:
                    return
                self._start_call(buf[:at])
                self._buf = buf[at + len(_NAME_END) :]
                self._scan_from = 0
                self._state = _ARGS
            else:  # _ARGS
                at, tag = _earliest(buf, (DSML_INVOKE_END, DSML_CALLS_END), self._scan_from)
                if tag is None:
                    self._scan_from = max(0, len(buf) - len(DSML_INVOKE_END) + 1)
                    return
                self._end_call(buf[:at])
                self._buf = buf[at + len(tag) :]
                self._state = _CALLS

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._state == _REASONING:
            self._out_reasoning.append(text)
        else:
            self._content(text)

    def _start_call(self, name: str) -> None:
        name = name.strip()
        self._name = name
        if not name:  # a call without a name cannot be answered: it is dropped, as DeepSeek's parser does
            self._call_emitted = False
            return
        index = self._num_calls
        self._num_calls += 1
        self._call_emitted = self._max_calls is None or index < self._max_calls
        if self._call_emitted:
            self._out_calls.append(ToolCallDelta(self._emitted_calls, self._new_id(), name, ""))

    def _end_call(self, raw: str) -> None:
        if not self._call_emitted:
            return
        assert self._tools is not None
        arguments = arguments_json(raw, self._tools.get(self._name))
        index = self._emitted_calls
        self._emitted_calls += 1
        calls = self._out_calls
        if calls and calls[-1].index == index:  # the header went out in this same push: one piece
            calls[-1] = calls[-1]._replace(arguments=arguments)
        else:
            calls.append(ToolCallDelta(index, None, None, arguments))
        self._call_emitted = False


def _earliest(buf: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """Position and text of the first complete tag in ``buf`` (tags never start at the same position)."""
    best, found = -1, None
    for tag in tags:
        at = buf.find(tag, start)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found


def _partial_tag_start(buf: str, tags: tuple[str, ...]) -> int:
    """Where a possibly unfinished tag starts at the end of ``buf`` (``len(buf)`` when none can).

    Every tag has exactly one ``<``, at its start, so only the tail from the last ``<`` can be one.
    """
    at = buf.rfind("<")
    if at < 0:
        return len(buf)
    tail = buf[at:]
    return at if any(tag.startswith(tail) for tag in tags) else len(buf)

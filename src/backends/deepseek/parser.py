"""Streaming parser for DeepSeek V4.1 completions: ``<think>`` reasoning and DSML tool calls.

DeepSeek's own ``deepseek-recipe`` (its ``StreamProcessor``) is the authority for these rules; the suite checks this
parser against it on a generated corpus (``tests/backends/deepseek/test_parser_recipe.py``), and
``docs/deepseek.md`` says why the gateway parses in Python and where it deliberately differs.

The engine hands text over one step at a time, split anywhere, including inside a tag. This state machine turns
each piece into three channels (reasoning, content, tool calls) so that the concatenated result never depends on
how the text was split. It holds back only what might still change: the tail from the last ``<`` while that tail is
a prefix of a tag it is looking for, a run of newlines at the end (dropped if a tag that ends the channel follows),
the name of a call until ``">``, and a call's parameters until ``</｜DSML｜ invoke>``.

Tool calls come out as OpenAI-shaped pieces: a call's id (``call_00_…``, its index in the choice and a random
part, as DeepSeek writes them) and name as soon as its name is complete (arguments ``""``), then its whole JSON
arguments when the invoke closes (in one piece when both land in the same push). Building the arguments at the end
of the invoke lets the unwrap rule and the schema typing see every parameter, and costs nothing per token.

Where parsing starts (``Stage``) comes from the prompt: thinking mode starts a new reasoning (``REASONING``), chat
mode starts the answer (``CONTENT``), and a ``prefix`` continuation of an assistant message continues its reasoning
or its answer (``REASONING_CONTINUATION``, ``CONTENT_CONTINUATION``).

States: REASONING, CONTENT, CALLS (once a call block or a call has begun, between invokes), NAME, ARGS, DONE.

- REASONING: ``</think>`` -> CONTENT; ``<｜DSML｜ calls>`` -> CALLS and ``<｜DSML｜ invoke name="`` -> NAME (a tool
  call ends the reasoning); ``<think>`` is text.
- CONTENT: a ``</think>`` is dropped; ``<｜DSML｜ calls>`` -> CALLS; ``<｜DSML｜ invoke name="`` without the calls
  wrapper -> NAME (it is a call); ``<think>`` is text (thinking happens only where the prompt opened it).
- CALLS: ``<｜DSML｜ invoke name="`` -> NAME; ``</｜DSML｜ calls>`` -> DONE; anything else is dropped.
- NAME: ``">`` -> ARGS (the call starts; its name is stripped, and a call with an empty name is dropped).
- ARGS: ``</｜DSML｜ invoke>`` -> CALLS; ``</｜DSML｜ calls>`` -> DONE.
- DONE: the calls end the turn (V4.1 writes EOS there): whatever follows is dropped, another call block included.

Newlines, as DeepSeek's parser treats them: those that open a new reasoning or an answer (after ``</think>``, or at
the start in chat mode) are dropped, and so are those right before a tag that ends the channel (``</think>`` in the
reasoning, a tool call in either; not a ``</think>`` in the answer, which is dropped alone); a continuation keeps its
leading newlines. A call opening cut by the end of the output once its ``<｜DSML｜`` is complete is markup, not text,
and is dropped with the newlines before it.
"""

from __future__ import annotations

import enum
import random
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from backends.deepseek.arguments import arguments_json
from backends.deepseek.markers import (
    DSML,
    DSML_CALLS_END,
    DSML_CALLS_START,
    DSML_INVOKE_END,
    DSML_INVOKE_START,
    THINK_END,
)
from backends.interface import ToolCallDelta

_CONTENT, _REASONING, _CALLS, _NAME, _ARGS, _DONE = range(6)

_NAME_END = '">'
_CALL_OPENINGS = (DSML_CALLS_START, DSML_INVOKE_START)
_CALLS_TAGS = (DSML_INVOKE_START, DSML_CALLS_END)
_CALL_MARKER = "<" + DSML
"""Once this much of a call opening is written, an output cut there ends in markup (DeepSeek drops it)."""
_ID_ALPHABET = string.ascii_letters + string.digits


def _call_opening(buf: str, at: int) -> str:
    """What the call marker at ``at`` opens: a calls block or a call; "" while ``buf`` ends inside such an opening;
    else the bare marker, after which the output is markup up to the next call, as deepseek-recipe reads it."""
    for opening in _CALL_OPENINGS:
        if buf.startswith(opening, at):
            return opening
        if opening.startswith(buf[at:]):
            return ""
    return _CALL_MARKER


class Stage(enum.Enum):
    """Where the completion starts, from the end of the prompt (DeepSeek's ``ThinkingInitialStage``)."""

    REASONING = "reasoning"
    """Thinking mode: a new reasoning (the prompt ends with ``<think>``); its leading newlines are dropped."""
    REASONING_CONTINUATION = "reasoning_continuation"
    """A ``prefix`` assistant message whose reasoning is continued: it keeps its leading newlines."""
    CONTENT = "content"
    """Chat mode: the answer (the prompt ends with ``</think>``); its leading newlines are dropped."""
    CONTENT_CONTINUATION = "content_continuation"
    """A ``prefix`` assistant message whose answer is continued: it keeps its leading newlines."""


class ParsedText(NamedTuple):
    """What one piece of completion text contributed to each channel."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCallDelta, ...]


NOTHING = ParsedText("", "", ())


def new_tool_call_id(index: int) -> str:
    """DeepSeek's call id: ``call_``, the call's index in its choice on two digits, ``_`` and 24 random letters or
    digits (unique per call; not a secret)."""
    return f"call_{index:02d}_" + "".join(random.choices(_ID_ALPHABET, k=24))


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

    ``stage``: where the completion starts (``Stage``); ``in_reasoning`` is the short form for a new turn
    (``True``: ``Stage.REASONING``, ``False``: ``Stage.CONTENT``).
    ``tools``: each declared tool's parameter schema (``tool_schemas``); ``None`` turns tool parsing off (DSML
    then stays content).
    ``max_calls``: calls past this many are parsed but not emitted (``parallel_tool_calls: false``).
    ``literal_content``: once in content, every character is content (no tags): for replies whose answer is
    constrained to a format, where a ``</think>`` inside a JSON string is data, not markup.
    ``new_id``: the id of the call with the given index.
    """

    __slots__ = (
        "_buf",
        "_call_emitted",
        "_emitted_calls",
        "_held_newlines",
        "_leading",
        "_literal",
        "_max_calls",
        "_name",
        "_new_id",
        "_num_calls",
        "_out_calls",
        "_out_content",
        "_out_reasoning",
        "_scan_from",
        "_state",
        "_stops",
        "_tags",
        "_tools",
    )

    def __init__(
        self,
        *,
        in_reasoning: bool | None = None,
        stage: Stage | None = None,
        tools: Mapping[str, Mapping[str, Any]] | None = None,
        max_calls: int | None = None,
        literal_content: bool = False,
        stops: Sequence[str] = (),
        new_id: Callable[[int], str] = new_tool_call_id,
    ) -> None:
        if stage is None:
            stage = Stage.REASONING if in_reasoning else Stage.CONTENT
        self._state = _REASONING if stage in (Stage.REASONING, Stage.REASONING_CONTINUATION) else _CONTENT
        self._leading = stage in (Stage.REASONING, Stage.CONTENT)  # the channel's leading newlines are dropped
        self._tools = tools
        self._tags: tuple[str, ...] = (THINK_END, _CALL_MARKER) if tools is not None else (THINK_END,)
        self._max_calls = max_calls
        self._literal = literal_content and tools is None
        self._new_id = new_id
        self._buf = ""
        self._scan_from = 0
        self._name = ""
        self._num_calls = 0  # calls started, emitted or not
        self._emitted_calls = 0
        self._call_emitted = False  # whether the call being parsed is emitted
        self._held_newlines = ""  # newlines at the end of the channel's text, until what follows them is known
        self._out_reasoning: list[str] = []
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []
        stops = [stop for stop in stops if stop]
        self._stops = AnswerStops(stops) if stops else None

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    @property
    def called(self) -> bool:
        """Whether at least one tool call was emitted (the choice then finishes with ``tool_calls``)."""
        return self._emitted_calls > 0

    @property
    def drops_leading_newlines(self) -> bool:
        """Whether the channel the reply is in still drops its leading newlines (a new reasoning or answer)."""
        return self._leading

    @property
    def matched_stop(self) -> str | None:
        """The stop sequence that ended the answer, once one did (nothing is parsed after it)."""
        return self._stops.matched if self._stops is not None else None

    def push(self, text: str) -> ParsedText:
        """Feed the next piece of text; returns what can be emitted now."""
        if not text:
            return NOTHING
        state = self._state
        if (
            state <= _REASONING and not self._buf and "<" not in text and (state == _REASONING or self._stops is None)
        ):  # fast path: no tag can start in this piece and no stop to look for, only newlines to drop or hold
            if self._leading:
                text = text.lstrip("\n")
                if not text:
                    return NOTHING
                self._leading = False
            held = self._held_newlines
            if text[-1] == "\n":  # as _emit_text: trailing newlines wait on what follows them
                kept = text.rstrip("\n")
                if not kept:
                    self._held_newlines = held + text
                    return NOTHING
                self._held_newlines, text = text[len(kept) :], kept
            elif held:
                self._held_newlines = ""
            if held:
                text = held + text
            return ParsedText(text, "", ()) if state == _REASONING else ParsedText("", text, ())
        self._buf += text
        self._scan()
        if self._stops is not None and self._state == _CONTENT:
            self._out_content.append(self._stops.releasable())
        return self._take()

    def finish(self) -> ParsedText:
        """End of the completion: release held text and close an unterminated call with the parameters it
        completed (an unfinished value, cut by ``max_tokens``, is left out rather than handed over half-written;
        so is the start of a call, cut after its ``<｜DSML｜``, with the newlines before it)."""
        state, buf = self._state, self._buf
        self._buf = ""
        if state in (_CONTENT, _REASONING):
            if self._tools is not None and buf.startswith(_CALL_MARKER):
                buf = self._held_newlines = ""  # a call cut short after its marker: markup, not text
            self._emit_text(buf)
            self._release_newlines()
            if self._stops is not None and self._state == _CONTENT:
                self._out_content.append(self._stops.restart())
        elif state == _ARGS:
            self._end_call(buf)
        # CALLS, DONE: nothing to send; NAME: a call whose name never finished, nothing of it was sent.
        self._state = _CONTENT
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

    def _scan(self) -> None:
        while True:
            state = self._state
            buf = self._buf
            if state == _CONTENT and self._literal:
                self._emit_text(buf)
                self._buf = ""
                return
            if state in (_CONTENT, _REASONING):
                tags = self._tags
                at, tag = _earliest(buf, tags)
                if tag is None:
                    keep = _partial_tag_start(buf, tags)
                    self._emit_text(buf[:keep])
                    if self._state == _DONE:  # a stop sequence
                        return
                    self._buf = buf[keep:]
                    if keep < len(buf) and self._stops is not None and state == _CONTENT:
                        self._stop_at(self._stops.peek(_seen_of(buf[keep:])))
                    return
                if tag == _CALL_MARKER:
                    tag = _call_opening(buf, at)
                self._emit_text(buf[:at])
                if self._state == _DONE:
                    return
                if not tag:  # an opening cut short: wait for the rest of it
                    self._buf = buf[at:]
                    return
                self._buf = buf[at + len(tag) :]
                if self._stops is not None and state == _CONTENT and self._stop_at_tag(tag):
                    return
                self._enter_tag(tag, state)
            elif state == _CALLS:
                at, tag = _earliest(buf, _CALLS_TAGS)
                if tag is None:
                    self._buf = buf[_partial_tag_start(buf, _CALLS_TAGS) :]
                    return
                self._buf = buf[at + len(tag) :]
                self._state = _NAME if tag == DSML_INVOKE_START else _DONE
            elif state == _DONE:
                self._buf = ""
                return
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
                self._state = _CALLS if tag == DSML_INVOKE_END else _DONE

    def _stop_at_tag(self, tag: str) -> bool:
        """A stop sequence ending in ``tag`` ends the answer (True); otherwise what the stop matcher held before
        the tag goes out, since a stop never spans a tag (with a </think>, the newlines before it too)."""
        assert self._stops is not None
        if self._stop_at(self._stops.peek(_seen_of(tag))):
            return True
        self._out_content.append(self._stops.restart() + (self._held_newlines if tag == THINK_END else ""))
        self._held_newlines = ""
        return False

    def _enter_tag(self, tag: str, state: int) -> None:
        """Move past a tag found in reasoning or content: </think> starts the answer (or is dropped inside it), a
        DSML tag starts a calls block or a call."""
        if tag == THINK_END:
            if state == _REASONING:  # the answer starts
                self._held_newlines = ""
                self._state = _CONTENT
                self._leading = True
            else:  # a </think> in the answer is dropped; the newlines before it are answer
                self._release_newlines()
        else:  # a DSML calls block, a call written without it, or a marker no opening follows
            self._held_newlines = ""
            self._state = _NAME if tag == DSML_INVOKE_START else _CALLS

    def _emit_text(self, text: str) -> None:
        """Text of the current channel: leading newlines dropped at its start, trailing ones held back."""
        if not text:
            return
        stops = self._stops if self._state == _CONTENT else None
        if self._leading:
            rest = text.lstrip("\n")
            if stops is not None and len(rest) < len(text) and self._stop_at(stops.see(text[: len(text) - len(rest)])):
                return
            if not rest:
                return
            if stops is not None:
                stops.restart()  # the newlines are gone: a stop cannot span them
            text = rest
            self._leading = False
        if stops is not None and self._stop_at(stops.see(text)):
            return
        text = self._held_newlines + text
        kept = text.rstrip("\n")
        self._held_newlines = text[len(kept) :]
        if not kept:
            return
        if self._state == _REASONING:
            self._out_reasoning.append(kept)
        elif stops is not None:
            stops.unsent += kept
        else:
            self._out_content.append(kept)

    def _stop_at(self, answer: str | None) -> bool:
        """A stop sequence matched (``answer``: the rest of the answer before it): the output ends here."""
        if answer is None:
            return False
        self._out_content.append(answer)
        assert self._stops is not None
        self._stops.unsent = ""  # the answer holds it
        self._held_newlines = self._buf = ""
        self._state = _DONE
        return True

    def _release_newlines(self) -> None:
        if self._held_newlines:
            if self._state == _REASONING:
                self._out_reasoning.append(self._held_newlines)
            elif self._stops is not None:
                self._stops.unsent += self._held_newlines
            else:
                self._out_content.append(self._held_newlines)
            self._held_newlines = ""

    def _start_call(self, name: str) -> None:
        name = name.strip()
        self._name = name
        if not name:  # a call without a name cannot be answered: it is dropped
            self._call_emitted = False
            return
        index = self._num_calls
        self._num_calls += 1
        self._call_emitted = self._max_calls is None or index < self._max_calls
        if self._call_emitted:
            self._out_calls.append(ToolCallDelta(self._emitted_calls, self._new_id(self._emitted_calls), name, ""))

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


class AnswerStops:
    """Stop sequences, matched as DeepSeek's parser matches them: in the answer only (not the reasoning, not a tool
    call's arguments), as soon as one is complete, over the answer's text since the last tag (a stop never spans a
    tag), including what is still held back: trailing newlines, the leading newlines of an answer until they are
    dropped, and a tag until it is recognized (all of ``</think>``, a call's ``<｜DSML｜``).

    ``view`` is that text; ``unsent`` is the part of it the parser's rules let out but a stop could still cut,
    ``sent`` how much of ``view`` went out.
    """

    __slots__ = ("_longest", "_stops", "matched", "sent", "unsent", "view")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = stops
        self._longest = max(map(len, stops))
        self.view = ""
        self.unsent = ""
        self.sent = 0
        self.matched: str | None = None

    def see(self, text: str) -> str | None:
        """Adds answer text; returns the answer's text before the stop if one now matches, else None."""
        start = max(0, len(self.view) - self._longest + 1)
        self.view += text
        return self._find(self.view, start)

    def peek(self, held: str) -> str | None:
        """Like ``see`` for text still held, which may yet turn out to be a tag."""
        return self._find(self.view + held, max(0, len(self.view) - self._longest + 1))

    def _find(self, view: str, start: int) -> str | None:
        """The first stop to be complete in ``view`` past what was searched (at the same end, the one listed first)."""
        first, first_end = -1, -1
        for stop in self._stops:
            at = view.find(stop, start)
            if at >= 0:
                end = at + len(stop)
                if first < 0 or end < first_end:
                    first, first_end, self.matched = at, end, stop
        return None if first < 0 else view[self.sent : first]

    def releasable(self) -> str:
        """The unsent text that no stop can cut any more: all of it but what could begin one."""
        view, hold = self.view, 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(view)), hold, -1):
                if view.endswith(stop[:k]):
                    hold = k
                    break
        count = min(len(self.unsent), len(view) - hold - self.sent)
        if count <= 0:
            return ""
        out, self.unsent = self.unsent[:count], self.unsent[count:]
        self.sent += count
        return out

    def restart(self) -> str:
        """A tag (or the answer's dropped leading newlines) ends the view: returns what was held for it."""
        out = self.unsent
        self.view, self.unsent, self.sent = "", "", 0
        return out


def _seen_of(tag: str) -> str:
    """What a stop may match of a tag: all of ``</think>``, a call's ``<｜DSML｜`` (what follows that is markup); a
    held partial tag is cut the same way."""
    return tag[: len(_CALL_MARKER)] if tag.startswith("<｜") else tag


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

"""One engine request's events: its choices' outputs, as they arrive in its buffer, turned into deltas, finishes,
prompt echoes and the usage.

``EngineEvents`` is what ``EngineBackend.generate`` returns: an async iterator whose first step prepares the
prompt and adds the request to the engine (``EngineBackend._open``), and a ``BatchStream`` from then on. Its
``EngineRun`` does the work of each event synchronously: ``ready()`` turns every output waiting in the buffer into
events, ``wait()`` is the buffer's next arrival. A streamed request therefore costs one wake-up per engine step,
not one coroutine chain per event; ``__anext__`` is the same work one event at a time for every other consumer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from backends.engine.buffer import OutputBuffer
from backends.engine.choice import Choice, finish_reason
from backends.engine.detokenizer import TokenTable
from backends.engine.driver import Sink
from backends.engine.prompts import ChatPrompt
from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, InvalidRequestError, SlowClientError, UpstreamError
from backends.interface import NOT_OPENED, Event, Finish, PromptEcho, PromptToken, Usage, never_notifies

INLINE_PROMPT_TOKENS = 512
"""Echoed prompts with logprobs longer than this are formatted on a worker thread (microseconds per token)."""


def _aborting(abort: Callable[[list[str]], None], live: set[str]) -> Callable[[], None]:
    """What aborts the engine requests still in ``live`` (a run's close, its buffer's overflow). It holds ``abort``
    and ``live``, not the run: as a method of the run it would make the run and its buffer a reference cycle, and
    every request's objects would wait for the cycle collector."""

    def abort_live() -> None:
        if live:
            abort(list(live))

    return abort_live


class EngineRun:
    """The choices of one request in the engine, from its added engine requests to its ``Usage``."""

    __slots__ = (
        "_abort",
        "_abort_live",
        "_cached",
        "_chat",
        "_choices",
        "_echo_text",
        "_echoed",
        "_ended",
        "_engine_ids",
        "_failed",
        "_job",
        "_live",
        "_outputs",
        "_pending",
        "_prompt_count",
        "_prompt_ids",
        "_prompt_unreported",
        "_reasoning",
        "_remaining",
        "_score_only",
        "_table",
    )

    def __init__(
        self,
        abort: Callable[[list[str]], None],
        engine_ids: list[str],
        choices: list[Choice],
        max_buffered_tokens: int | None,
        prompt_ids: np.ndarray,
        table: TokenTable,
        chat: ChatPrompt | None,
        *,
        echo_text: str | None,
        scoring: bool,
        score_only: bool,
        prompt_count: int | None = None,
    ) -> None:
        """``prompt_count``: the prompt's tokens as the engine counts them (images expanded); default: its ids."""
        self._abort = abort
        self._engine_ids = engine_ids
        self._choices = choices
        self._live = set(engine_ids)
        self._abort_live = _aborting(abort, self._live)
        self._outputs = OutputBuffer(max_buffered_tokens, self._abort_live)
        self._prompt_ids = prompt_ids
        self._prompt_count = len(prompt_ids) if prompt_count is None else prompt_count
        self._table = table
        self._chat = chat
        self._reasoning = chat is not None and chat.parser is not None
        self._echo_text = echo_text or ""
        self._score_only = score_only
        self._remaining = len(engine_ids)
        self._echoed = [not scoring] * len(engine_ids)  # scoring: a choice's first output carries the prompt's scores
        self._prompt_unreported = True
        self._cached: list[int | None] = [None] * len(engine_ids)  # each choice's cached prompt tokens
        self._ended = False
        self._failed: BaseException | None = None  # what ends the stream, after the batch ``ready`` returned
        self._job: tuple[int, Sequence[EngineOutput], asyncio.Future[list[PromptToken]]] | None = None
        self._pending: deque[Event] = deque()
        if echo_text is not None and not scoring:  # the echo needs nothing from the engine: it goes first
            self._pending.extend(PromptEcho(index, echo_text) for index in range(len(engine_ids)))

    @property
    def sink(self) -> Sink:
        """Where the driver puts the engine requests' outputs (choice index, outputs or error)."""
        return self._outputs.put

    def ready(self) -> list[Event]:
        """Every event the outputs received so far make (see ``BatchStream``)."""
        batch: list[Event] = []
        try:
            while (event := self.next_event()) is not None:
                batch.append(event)
        except StopAsyncIteration:
            if not batch:
                raise
            # the events before it go out first; the next call raises a new one (not this one, whose traceback
            # holds this frame and so the run: a reference cycle for every request's end)
        except BaseException as exc:
            if not batch:
                raise
            self._failed = exc  # the events before it go out first
        return batch

    def wait(self) -> Awaitable[None]:
        """Done once ``ready`` may have something: the next outputs, or a scored prompt formatted."""
        job = self._job
        if job is None:
            return self._outputs.arrival()
        return _settled(job[2])

    def notify(self, callback: Callable[[], None]) -> bool:
        """``Notifying.notify``: the next output the driver puts calls ``callback`` from the driver's delivery."""
        if self._job is not None or self._pending or self._failed is not None or not self._remaining:
            return False
        return self._outputs.listen(callback)

    def next_event(self) -> Event | None:
        """The next event, None while the engine has sent nothing new; raises as ``ready`` does."""
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        pending = self._pending
        try:
            while not pending:
                if self._job is not None:
                    if not self._job[2].done():
                        return None
                    self._echo_scored()
                elif self._remaining:
                    entry = self._outputs.pop()
                    if entry is None:
                        return None
                    self._take(*entry)
                elif self._ended:
                    raise StopAsyncIteration
                else:
                    self._ended = True
                    return self._usage()
        except StopAsyncIteration:
            raise
        except BaseException:
            self.close()  # the stream ends with its error: nothing more comes, the engine stops the rest
            raise
        return pending.popleft()

    def close(self) -> None:
        """Ends the run: its engine requests still running are aborted and ``ready`` ends the stream."""
        self._remaining = 0
        self._ended = True
        self._pending.clear()
        self._outputs.unlisten()  # a writer that stopped waiting (its client gone) is not called, nor kept
        if self._job is not None:
            self._job[2].cancel()
            self._job = None
        self._abort_live()
        self._live.clear()

    def _take(self, index: int, item: Sequence[EngineOutput] | BackendError) -> None:
        if isinstance(item, BackendError):
            self._live.discard(self._engine_ids[index])
            raise blame_constraint(item, self._chat)
        if self._cached[index] is None:  # the first output carries the prompt's cache hits
            self._cached[index] = item[0].num_cached_tokens
        if not self._echoed[index]:  # the prompt step's output carries the prompt logprobs
            self._echoed[index] = True
            if item[0].finished:
                finish_reason(item[0])  # raises for a request that ended in error before it ran
            scores = item[0].prompt_logprobs
            if len(self._prompt_ids) > INLINE_PROMPT_TOKENS:
                job = asyncio.ensure_future(asyncio.to_thread(prompt_tokens, self._table, self._prompt_ids, scores))
                self._job = (index, item, job)
                return
            self._pending.append(
                PromptEcho(index, self._echo_text, prompt_tokens(self._table, self._prompt_ids, scores))
            )
        self._outputs_of(index, item)

    def _echo_scored(self) -> None:
        assert self._job is not None
        index, item, job = self._job
        self._job = None
        self._pending.append(PromptEcho(index, self._echo_text, job.result()))
        self._outputs_of(index, item)

    def _outputs_of(self, index: int, item: Sequence[EngineOutput]) -> None:
        """A step's outputs for one choice: its delta and, when it ends, its finish."""
        engine_id = self._engine_ids[index]
        if self._score_only:
            self._remaining -= 1
            if item[-1].finished:
                finish_reason(item[-1])  # raises for a request the engine refused (context, resources)
            else:
                self._abort([engine_id])
            self._live.discard(engine_id)
            self._pending.append(Finish(index, "length"))
            return
        choice = self._choices[index]
        try:
            delta, finish = choice.consume(item)
        except InvalidRequestError as exc:
            raise blame_constraint(exc, self._chat) from None
        if finish is not None:
            self._remaining -= 1
            if not item[-1].finished:  # a stop string ended it: the engine still runs it
                self._abort([engine_id])
            self._live.discard(engine_id)
        if delta is not None:
            if self._prompt_unreported:  # a request cut short before its usage is charged its exact prompt
                self._prompt_unreported = False
                delta = delta._replace(prompt_tokens=self._prompt_count)
            self._pending.append(delta)
        if finish is not None:
            self._pending.append(Finish(index, finish, choice.end_logprobs, choice.matched_stop))

    def _usage(self) -> Usage:
        prompt = self._prompt_count
        # The prompt is counted once for all choices: its hits are those every choice's engine request had.
        cached = min((c for c in self._cached if c is not None), default=0)
        if self._score_only:
            return Usage(prompt, 0, None, cached)
        reasoning = sum(c.reasoning_tokens for c in self._choices) if self._reasoning else None
        return Usage(prompt, sum(c.tokens for c in self._choices), reasoning, cached)


class EngineEvents:
    """The event stream ``EngineBackend.generate`` returns: ``open`` (prepare, add) on the first step, then the
    run's events; closing it aborts what the engine still runs for it."""

    __slots__ = ("_closed", "_open", "_run", "notify", "ready", "wait")

    def __init__(self, open_run: Callable[[], Awaitable[EngineRun]]) -> None:
        self._open = open_run
        self._run: EngineRun | None = None
        self._closed = False
        # ``BatchStream``: the run's own methods once the request is in the engine, so a consumer's call goes
        # straight to the run
        self.ready: Callable[[], list[Event]] = NOT_OPENED.ready
        self.wait: Callable[[], Awaitable[None]] = NOT_OPENED.wait
        self.notify: Callable[[Callable[[], None]], bool] = never_notifies

    def __aiter__(self) -> EngineEvents:
        return self

    async def __anext__(self) -> Event:
        run = self._run
        if run is None:
            if self._closed:
                raise StopAsyncIteration
            run = self._run = await self._open()
            if self._closed:  # closed while it opened
                run.close()
                raise StopAsyncIteration
            self.ready, self.wait, self.notify = run.ready, run.wait, run.notify
        while True:
            event = run.next_event()
            if event is not None:
                return event
            await run.wait()

    async def aclose(self) -> None:
        self._closed = True
        if self._run is not None:
            self._run.close()


async def _settled(job: asyncio.Future[list[PromptToken]]) -> None:
    """Waits for ``job`` without raising its error: that comes from ``ready``."""
    await asyncio.wait([job])


def blame_constraint(error: BackendError, chat: ChatPrompt | None) -> BackendError:
    """An engine's refusal of a constrained request names the request field that asked for the constraint."""
    if (
        isinstance(error, InvalidRequestError)
        and not isinstance(error, SlowClientError)
        and error.param is None
        and chat is not None
        and chat.so_param
    ):
        error.param = chat.so_param
    return error


def prompt_tokens(
    table: TokenTable, prompt_ids: Sequence[int] | np.ndarray, values: Sequence[float] | None
) -> list[PromptToken]:
    """The echoed prompt's tokens with their logprobs and character offsets in the echoed text.

    The engine scores every token but the first (``values[i]`` is for ``prompt_ids[i + 1]``) and gives no
    alternatives for prompt positions. Offsets count the characters each token's bytes start, so special tokens
    that the text leaves out (BOS) take no room.
    """
    if values is None or len(values) != len(prompt_ids) - 1:
        raise UpstreamError(
            f"the engine returned {0 if values is None else len(values)} prompt logprobs for a prompt of "
            f"{len(prompt_ids)} tokens"
        )
    text_of, bytes_of = table.text_of, table.bytes_of
    pieces = [bytes_of[i] for i in prompt_ids]
    joined = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    starts_char = np.r_[0, np.cumsum((joined & 0xC0) != 0x80)]  # characters begun before each byte position
    byte_starts = np.r_[0, np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)))[:-1]]
    offsets = starts_char[byte_starts].tolist()
    logprobs: list[float | None] = [None, *values]
    return list(map(PromptToken, [text_of[i] for i in prompt_ids], logprobs, offsets))

"""Drives one synchronous engine from its own thread and feeds its outputs to the asyncio loop.

DeepInfer's engine must be constructed, stepped and closed from a single thread, and its outputs die at
the next ``step()``. The driver owns that thread: it drains an inbox of add/abort commands, steps while
work exists, flushes once when the engine goes idle, then blocks on the inbox. Each step's outputs are
handed to the event loop with exactly one ``call_soon_threadsafe``; grouping, detokenizing and parsing
happen on the loop, never on the engine thread.

Backpressure: the engine thread runs at most ``STEPS_AHEAD`` hand-offs ahead of the loop. A hand-off counts as
taken once the loop has run it and then every stream task it woke (a ``call_soon`` queued behind them), so the
engine cannot bury a busy loop under outputs it has no time to send: memory stays bounded and the loop keeps
the time to notice clients that leave. Streams whose clients do not read are not waited for (their tasks sleep
on the socket); their own buffers bound them (``backends.engine.buffer``).

What DeepInfer's engine does, and the loop relies on (tests/backends/deepinfer/real/):

- A request's outputs, its final one included, come from ``step()``; under zero-overhead scheduling a decode
  step's tokens come from the next ``step()``. A request is finished when an output says so, never by the
  engine going idle.
- A finished request still counts in ``has_unfinished_requests()`` until the next ``step()``, so the loop runs
  one step more, which returns nothing for it.
- ``flush_inflight_reqs()`` returns nothing once ``has_unfinished_requests()`` is False (DeepInfer's real engine);
  the flush on going idle is for engines that keep a step in flight past that point.
- An aborted running request gets no further output; a request aborted while waiting gets one final ``abort``
  output. Either way its sink is gone by then (``abort`` drops it at once) and late outputs are dropped.
- With data parallelism ``has_unfinished_requests()`` and ``step()`` are collectives: the workers' lockstep loop
  drives those engines, not this one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.engine.protocol import Engine, EngineOutput
from backends.errors import BackendError, InvalidRequestError, UnavailableError, UpstreamError

logger = logging.getLogger(__name__)

Sink = Callable[[int, Sequence[EngineOutput] | BackendError], None]
"""Receives, on the event loop, a choice index and either that step's outputs or a terminal error."""

STEPS_AHEAD = 2
"""Hand-offs the engine thread may have made that the event loop has not yet taken (see the module docstring)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    sampling_params: dict[str, Any]
    prompt_token_ids: np.ndarray
    user_id: str
    multi_modal_data: dict[str, Any] | None = None


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


@dataclass(slots=True)
class DriverStats:
    """Counters the engine thread updates without locks (single writer); read for metrics and benches."""

    steps: int = 0
    tokens: int = 0
    busy_seconds: float = 0.0
    """Engine-thread time not spent waiting for work: engine calls plus the driver's own bookkeeping."""
    engine_seconds: float = 0.0
    """The part of ``busy_seconds`` spent inside the engine's ``step()`` / ``flush_inflight_reqs()``."""
    backpressure_seconds: float = 0.0
    """Engine-thread time spent waiting for the event loop to take earlier outputs (not part of ``busy_seconds``)."""


class EngineDriver:
    """One engine, one thread, one inbox."""

    def __init__(self, engine_factory: Callable[[], Engine], *, name: str) -> None:
        self.name = name
        self._factory = engine_factory
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Sink, int]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine: Engine | None = None
        self._credits = threading.Semaphore(STEPS_AHEAD)
        self._stopping = False
        self.stats = DriverStats()
        self.failure: str | None = None
        """Why the engine is not usable (construction or step failed), for readiness."""

    @property
    def alive(self) -> bool:
        return self.engine is not None and self.failure is None and self._thread is not None

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    async def start(self) -> None:
        """Constructs the engine on the driver thread; raises if construction fails."""
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(started,), name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        await started

    async def stop(self) -> None:
        """Fails outstanding requests, closes the engine on its thread and joins it."""
        for request_id in list(self._sinks):
            self._fail(request_id, UnavailableError(f"backend {self.name!r} is shutting down"))
        if self._thread is not None and self._thread.is_alive():
            self._stopping = True
            self._inbox.put(_Stop())
            self._credits.release()  # the engine thread may be waiting for a loop that no longer takes outputs
            await asyncio.to_thread(self._thread.join)

    def add(
        self,
        request_id: str,
        sampling_params: dict[str, Any],
        prompt_token_ids: np.ndarray,
        sink: Sink,
        index: int,
        user_id: str = "",
        multi_modal_data: dict[str, Any] | None = None,
    ) -> int | None:
        """Queues the request for the engine thread. Returns the data-parallel rank that takes it: None here, with
        one engine (``DataParallelDriver.add`` names a rank)."""
        if not self.alive:
            raise UnavailableError(f"backend {self.name!r} is not running: {self.failure or 'not started'}")
        self._sinks[request_id] = (sink, index)
        self._inbox.put(_Add(request_id, sampling_params, prompt_token_ids, user_id, multi_modal_data))
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Stops the requests now: their sinks are dropped at once, the engine is told on its next turn."""
        live = [r for r in request_ids if self._sinks.pop(r, None) is not None]
        if live and self.alive:
            self._inbox.put(_Abort(live))

    # ---- event-loop side -------------------------------------------------------------------------

    def _dispatch(self, outputs: Sequence[EngineOutput], errors: list[tuple[str, BackendError]]) -> None:
        try:
            grouped: dict[str, list[EngineOutput]] = {}
            for out in outputs:
                group = grouped.get(out.request_id)
                if group is None:
                    grouped[out.request_id] = [out]
                else:
                    group.append(out)
            sinks = self._sinks
            for request_id, group in grouped.items():
                entry = sinks.get(request_id)
                if entry is None:
                    continue  # aborted: late outputs are dropped
                if group[-1].finished:
                    del sinks[request_id]
                entry[0](entry[1], group)
            for request_id, error in errors:
                self._fail(request_id, error)
        finally:
            # Queued behind the stream tasks this hand-off woke, so it runs once they have sent what they got.
            asyncio.get_running_loop().call_soon(self._credits.release)

    def _fail(self, request_id: str, error: BackendError) -> None:
        entry = self._sinks.pop(request_id, None)
        if entry is not None:
            entry[0](entry[1], error)

    def _engine_died(self, reason: str) -> None:
        self.failure = reason
        for request_id in list(self._sinks):
            self._fail(request_id, UpstreamError(f"engine of backend {self.name!r} failed: {reason}"))

    # ---- engine thread -------------------------------------------------------------------------------

    def _run(self, started: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            engine = self._factory()
        except BaseException as exc:  # construction errors must reach start(), whatever they are
            self.failure = f"engine construction failed: {exc!r}"
            loop.call_soon_threadsafe(_set_exception, started, exc)
            return
        self.engine = engine
        loop.call_soon_threadsafe(_set_result, started)
        try:
            self._serve(engine, loop)
        except Exception as exc:
            logger.exception("engine %s failed", self.name)
            loop.call_soon_threadsafe(self._engine_died, repr(exc))
        finally:
            try:
                engine.close()
            except Exception:
                logger.exception("engine %s failed to close", self.name)

    def _serve(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        inbox = self._inbox
        stats = self.stats
        clock = time.perf_counter
        dispatch = self._dispatch
        credits = self._credits

        def hand_off(outputs: Sequence[EngineOutput], errors: list[tuple[str, BackendError]]) -> None:
            if not self._stopping and not credits.acquire(blocking=False):
                waiting = clock()
                credits.acquire()  # the loop is STEPS_AHEAD hand-offs behind: wait for it
                stats.backpressure_seconds += clock() - waiting
            loop.call_soon_threadsafe(dispatch, outputs, errors)

        needs_flush = False
        command: _Add | _Abort | _Stop | None = None
        awake = clock()
        paced = stats.backpressure_seconds  # waits for the loop are not busy time
        while True:
            errors: list[tuple[str, BackendError]] = []
            aborts: list[str] = []
            while True:
                if command is None:
                    try:
                        command = inbox.get_nowait()
                    except queue.Empty:
                        break
                if isinstance(command, _Stop):
                    if aborts:
                        engine.abort_request(aborts)
                    return
                if isinstance(command, _Add):
                    error = _add(engine, command)
                    if error is not None:
                        errors.append((command.request_id, error))
                else:
                    aborts.extend(command.request_ids)
                command = None
            if aborts:
                engine.abort_request(aborts)
            before_step = clock()
            if engine.has_unfinished_requests():
                outputs = engine.step()
                needs_flush = True
            elif needs_flush:
                outputs = engine.flush_inflight_reqs()
                needs_flush = False
            else:
                if errors:
                    hand_off((), errors)
                stats.busy_seconds += clock() - awake - (stats.backpressure_seconds - paced)
                command = inbox.get()  # idle: block until there is work
                awake = clock()
                paced = stats.backpressure_seconds
                continue
            after_step = clock()
            stats.steps += 1
            if outputs or errors:
                stats.tokens += len(outputs)
                hand_off(outputs, errors)
            now = clock()
            stats.engine_seconds += after_step - before_step
            stats.busy_seconds += now - awake - (stats.backpressure_seconds - paced)
            awake = now
            paced = stats.backpressure_seconds


def _add(engine: Engine, command: _Add) -> BackendError | None:
    """Adds one request; DeepInfer reports bad input by raising or by returning ``None``."""
    try:
        sequence = engine.add_request(
            user_id=command.user_id,
            request_id=command.request_id,
            sampling_params=command.sampling_params,
            prompt_token_ids=command.prompt_token_ids,
            multi_modal_data=command.multi_modal_data,
        )
    except (ValueError, TypeError, KeyError) as exc:
        return InvalidRequestError(f"the engine rejected the request: {exc}")
    except BackendError as exc:  # an engine binding's verdict on this one request; the engine itself is fine
        return exc
    if sequence is None:
        return InvalidRequestError("the prompt contains token ids outside the model's vocabulary")
    return None


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

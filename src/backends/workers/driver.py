"""Drives N engine ranks in worker processes, with the same surface as ``EngineDriver`` so ``EngineBackend`` serves
from them unchanged.

Everything runs on the event loop, without threads: one ZeroMQ DEALER per rank (connected to the worker's bound
endpoint, read through ``loop.add_reader``), one pidfd per local worker process to learn of its exit at once.
``add``/``abort`` queue commands per rank and one ``call_soon`` flushes them as ONE message per rank per loop
iteration; each worker step arrives as ONE message whose outputs go to the request sinks, as the in-process driver
does per step. Load (outstanding requests, queued prompt tokens) is kept here, from what was sent and from the
first output of each request (its prefill is done), so choosing a rank costs no round trip.

Failure: a rank that exits, reports ``FAILED``, falls silent or is not ready by its start deadline fails its
in-flight requests with an ``UpstreamError`` and is restarted with exponential backoff while the other ranks serve.
In lockstep mode a dead rank leaves its peers blocked inside a collective, so the whole group is killed, its
requests failed, and restarted together once every old process is gone. When to restart is decided by
``RankSupervisor`` (``supervisor.py``), a state machine on the loop's clock; ``RankLifecycle``
(``rank_lifecycle.py``) carries it out (launches, connections, exits, heartbeats, take-downs) and this module keeps
the dispatch I/O. What the dispatcher knows of each rank is in ``ranks.py``; how a local rank's process is started,
in ``launch.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from itertools import groupby
from operator import itemgetter
from typing import Any, cast

import numpy as np
import zmq
from tokenizers import Tokenizer

from backends.engine.driver import DriverStats, Sink
from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, UnavailableError
from backends.workers import messages as m
from backends.workers.balancer import RankBalancer
from backends.workers.launch import WorkerPlan
from backends.workers.rank_lifecycle import RankLifecycle
from backends.workers.ranks import RankedEngineView, RankState
from backends.workers.supervisor import Clock, RankSupervisor

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 15.0
"""How long ``stop()`` waits for workers to close their engines before killing them."""
_UINT64 = 0xFFFF_FFFF_FFFF_FFFF
_as_output: Callable[[tuple[Any, ...]], EngineOutput] = partial(tuple.__new__, EngineOutput)
"""An output as it came off the wire (``EngineOutput`` fields in order) as the record, without a Python call."""
_request_id = itemgetter(0)


class _Entry:
    """One engine request in flight: where its outputs go and which rank holds it."""

    __slots__ = ("index", "queued", "rank", "sink")

    def __init__(self, sink: Sink, index: int, rank: int, queued: int) -> None:
        self.sink = sink
        self.index = index
        self.rank = rank
        self.queued = queued  # prompt tokens not yet prefilled (0 after the first output)


class DataParallelDriver:
    """N ranks behind one add/abort/sink surface; see the module docstring."""

    def __init__(
        self,
        name: str,
        plan: WorkerPlan,
        load_tokenizer: Callable[[], Tokenizer],
        balancer: RankBalancer | None = None,
        clock: Clock | None = None,
    ) -> None:
        if plan.size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if plan.remote_endpoints and len(plan.remote_endpoints) != plan.size:
            raise ValueError("worker_endpoints must name one endpoint per data-parallel rank")
        self.name = name
        self.plan = plan
        self._load_tokenizer = load_tokenizer
        self.balancer = balancer or RankBalancer(plan.size)
        self.clock = clock
        """The supervisor's clock and timers; None: the event loop's."""
        self.engine: RankedEngineView | None = None
        self.ranks: list[RankState] = []
        self._sinks: dict[str, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_pending = False
        self._last_prompt: np.ndarray | None = None
        self._last_rank = -1
        self.identity = f"{os.getpid()}-{os.urandom(4).hex()}".encode()
        """This dispatcher's ZeroMQ routing id: ranks serving several front ends keep their requests apart by it."""
        self.lifecycle = RankLifecycle(
            name, plan, self.identity, self.balancer, self._send, self._on_readable, self._fail, self._schedule_flush
        )
        """Each rank's process, socket and liveness: what the supervisor decides, carried out."""

    # ---- the EngineDriver surface ----------------------------------------------------------------------------------

    @property
    def stats(self) -> DriverStats:
        total = DriverStats()
        for rank in self.ranks:
            t = rank.totals()
            total.steps += t.steps
            total.tokens += t.tokens
            total.busy_seconds += t.busy_seconds
            total.engine_seconds += t.engine_seconds
        return total

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    @property
    def supervisor(self) -> RankSupervisor | None:
        """When ranks restart (set up at ``start``)."""
        return self.lifecycle.supervisor

    @property
    def alive(self) -> bool:
        return self.engine is not None and not self.lifecycle.stopping and any(self._usable(r) for r in self.ranks)

    @property
    def failure(self) -> str | None:
        """Why no rank can serve, once started (``None`` while at least one can, or before the first start)."""
        if self.engine is None or self.lifecycle.stopping or self.alive:
            return None
        return f"0/{self.plan.size} ranks up: {self._reasons()}"

    def describe(self) -> str:
        """Readiness detail: ``4/4 ranks up``, or which are down and why."""
        up = sum(self._usable(r) for r in self.ranks)
        text = f"{up}/{self.plan.size} ranks up"
        if up < self.plan.size:
            text += f" ({self._reasons()})"
        return text

    async def start(self) -> None:
        """Starts every rank and returns once each is up or has failed (a rank that fails to build is restarted
        with backoff like any other, while ``/ready`` says why); raises (and cleans up) if it cannot start."""
        self._loop = loop = asyncio.get_running_loop()
        lifecycle = self.lifecycle
        lifecycle.open(loop)
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer))
        self.ranks = lifecycle.new_ranks()
        started = lifecycle.begin(self.clock)
        try:
            assert lifecycle.supervisor is not None
            lifecycle.supervisor.start()
            await started
            tokenizer = await tokenizer_task
        except BaseException:
            tokenizer_task.cancel()
            await self.stop()
            raise
        self.engine = RankedEngineView(tokenizer, self)

    async def stop(self) -> None:
        """Fails outstanding requests, has every local rank close its engine (together, in lockstep), reaps them."""
        self.lifecycle.begin_stop()
        for request_id in list(self._sinks):
            self._fail(request_id, UnavailableError(f"backend {self.name!r} is shutting down"))
        for rank in self.ranks:
            if rank.socket is not None and not self._send(rank, [m.RESET] if rank.remote else [m.STOP]):
                logger.warning("rank %d of %s has a full queue: killed if it does not stop", rank.index, self.name)
        waiting = [r.exited for r in self.ranks if r.exited is not None and not r.exited.done()]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=STOP_TIMEOUT_SECONDS)
            if late:
                for rank in self.ranks:
                    if rank.process is not None and rank.process.poll() is None:
                        logger.warning("rank %d of %s did not stop in time; killing it", rank.index, self.name)
                        rank.process.kill()
                await asyncio.wait(late, timeout=STOP_TIMEOUT_SECONDS)
        self.lifecycle.close()

    def add(
        self,
        request_id: str,
        sampling_params: dict[str, Any],
        prompt_token_ids: np.ndarray,
        sink: Sink,
        index: int,
        user_id: str = "",
        multi_modal_data: dict[str, Any] | None = None,
    ) -> int:
        """Sends the request to the rank the balancer picks (in the next flush); returns that rank's index."""
        if not self.alive:
            raise UnavailableError(f"backend {self.name!r} has no rank up: {self._reasons()}", retry_after=1.0)
        rank, prefix = self._choose(prompt_token_ids)
        seed = sampling_params.get("seq_seed")
        if seed is not None:
            sampling_params = {**sampling_params, "seq_seed": seed & _UINT64}  # DeepInfer's own wrap-around
        queued = len(prompt_token_ids)
        self._sinks[request_id] = _Entry(sink, index, rank.index, queued)
        rank.requests.add(request_id)
        rank.queued_tokens += queued
        rank.dispatched += 1
        rank.adds.append(
            [request_id, sampling_params, prompt_token_ids.tobytes(), user_id, prefix, *m.images_wire(multi_modal_data)]
        )
        self._schedule_flush()
        return rank.index

    def abort(self, request_ids: list[str]) -> None:
        """Stops the requests now: sinks dropped at once, each rank holding one is told in the next flush."""
        for request_id in request_ids:
            entry = self._sinks.pop(request_id, None)
            if entry is None:
                continue
            rank = self.ranks[entry.rank]
            self._forget(rank, request_id, entry)
            if rank.socket is not None:
                rank.aborts.append(request_id)
        self._schedule_flush()

    # ---- choosing a rank and sending -------------------------------------------------------------------------------

    def _usable(self, rank: RankState) -> bool:
        if rank.state != "up":
            return False
        return not self.plan.lockstep or all(r.state == "up" for r in self.ranks)

    def _choose(self, prompt: np.ndarray) -> tuple[RankState, bytes]:
        """The rank for a prompt, and its prefix hashes for the rank to pass on (empty when already sent)."""
        # The n choices of one request share its prompt array: keep them on one rank (one prefill, one cache).
        if prompt is self._last_prompt and self._usable(self.ranks[self._last_rank]):
            return self.ranks[self._last_rank], b""
        balancer = self.balancer
        # Our own load on each rank, known exactly, plus what the rank last reported holding for other dispatchers.
        loads = [
            balancer.load(r.outstanding + r.others.requests, r.queued_tokens + r.others.queued_prompt_tokens)
            for r in self.ranks
        ]
        prefix = balancer.prefix_hashes(prompt)
        index = balancer.choose_for(prefix, loads, [self._usable(r) for r in self.ranks])
        self._last_prompt = prompt
        self._last_rank = index
        return self.ranks[index], prefix.tobytes()

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        sent: list[RankState] = []
        added = False
        for rank in self.ranks:
            if not rank.has_commands:
                continue
            if rank.socket is None:
                rank.adds = []
                rank.aborts = []
                rank.credited = rank.taken
            elif self._send(rank, [m.BATCH, rank.adds, rank.aborts, rank.taken]):
                sent.append(rank)
                added = added or bool(rank.adds)
                rank.adds = []
                rank.aborts = []
                rank.credited = rank.taken
            # else the rank's queue is full (it is inside a long step): the commands stay queued here and go,
            # merged with later ones, when it has read (``_on_readable``); none is ever dropped
        if added and self.plan.lockstep:
            # Idle ranks wait on their inbox between the group's has_unfinished_requests calls: wake them now,
            # so the rank given work does not wait in the collective for the others' poll timeout.
            for rank in self.ranks:
                # A wake-up (redundant if its queue is full), with the credit if one is due.
                if rank not in sent and rank.socket is not None and self._send(rank, [m.BATCH, [], [], rank.taken]):
                    rank.credited = rank.taken

    def _send(self, rank: RankState, message: list[Any]) -> bool:
        """Sends without blocking; False if the rank's queue is full (``messages.QUEUE_MESSAGES``)."""
        socket = rank.socket
        assert socket is not None and self._loop is not None
        sent = True
        try:
            socket.send(m.pack(message), zmq.NOBLOCK)
        except zmq.Again:
            sent = False
        except zmq.ZMQError as exc:  # a broken socket: the rank's heartbeat or exit will take it down
            logger.error("cannot send to rank %d of %s: %s", rank.index, self.name, exc)
        # ZeroMQ's descriptor is edge-triggered and any operation may consume its edge: reading ZMQ_EVENTS re-arms
        # it, and tells whether messages are already waiting that no edge will announce.
        if cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._loop.call_soon(self._on_readable, rank.index)
        return sent

    # ---- receiving -------------------------------------------------------------------------------------------------

    def _on_readable(self, index: int) -> None:
        rank = self.ranks[index]
        socket = rank.socket
        while socket is not None and rank.socket is socket:
            try:
                data = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                if rank.has_commands:  # held back by a full queue; the worker may have read since
                    self._schedule_flush()
                return
            rank.last_heard = time.monotonic()
            message = m.unpack_event(data)
            kind = message[0]
            if kind == m.STEP:
                rank.report(m.RankStats(*message[4]))
                rank.others = m.RankLoad(*message[5])
                self._learn(rank, message[6])
                self._dispatch(rank, message[2], message[3])
                # One step per turn: it is taken, and the next read, after the stream tasks it woke have sent their
                # frames (and aborted what their clients left), so the rank's credit tracks what clients were sent.
                assert self._loop is not None
                self._loop.call_soon(self._took, rank, socket, message[1])
                return
            elif kind == m.HEARTBEAT:
                rank.report(m.RankStats(*message[1]))
                rank.others = m.RankLoad(*message[2])
                self._learn(rank, message[3])
            elif kind == m.READY:
                self.lifecycle.on_ready(rank, message[1], m.EngineInfo(*message[2]), message[3])
            elif kind == m.STARTING:
                self.lifecycle.on_starting(rank, message[1], *message[2])
            elif kind == m.FAILED:
                self.lifecycle.rank_failed(rank, f"engine failed: {message[1]}")
            elif kind == m.CLOSED:
                rank.reason = "closed"

    def _learn(self, rank: RankState, prefixes: Sequence[bytes]) -> None:
        """Prompts other dispatchers sent this rank: their prefixes are found there from here too."""
        if rank.state == "up":
            for prefix in prefixes:
                self.balancer.learn(rank.index, prefix)

    def _took(self, rank: RankState, socket: zmq.Socket, seq: int) -> None:
        """A step message's outputs are taken: the rank gets the credit (with the aborts they caused, in one
        ``BATCH``), and the next message is read."""
        if rank.socket is not socket:
            return  # taken down meanwhile
        if seq != rank.taken:
            rank.taken = seq
            self._flush()
        self._on_readable(rank.index)

    def _dispatch(self, rank: RankState, outputs: Sequence[tuple[Any, ...]], errors: Sequence[Any]) -> None:
        # Records are built and grouped in C (a step lists each request's outputs together): Python runs once per
        # request per step, not once per token.
        grouped: dict[str, list[EngineOutput]] = {}
        for request_id, run in groupby(map(_as_output, outputs), _request_id):
            group = grouped.get(request_id)
            if group is None:
                grouped[request_id] = list(run)
            else:
                group.extend(run)
        sinks = self._sinks
        for request_id, group in grouped.items():
            entry = sinks.get(request_id)
            if entry is None:
                continue  # aborted: late outputs are dropped
            if entry.queued:
                rank.queued_tokens -= entry.queued
                entry.queued = 0
            if group[-1][2]:  # finished
                del sinks[request_id]
                rank.requests.discard(request_id)
            entry.sink(entry.index, group)
        for request_id, kind, message in errors:
            self._fail(request_id, m.rebuild_error(kind, message))

    def _fail(self, request_id: str, error: BackendError) -> None:
        entry = self._sinks.pop(request_id, None)
        if entry is not None:
            self._forget(self.ranks[entry.rank], request_id, entry)
            entry.sink(entry.index, error)

    @staticmethod
    def _forget(rank: RankState, request_id: str, entry: _Entry) -> None:
        rank.requests.discard(request_id)
        rank.queued_tokens -= entry.queued
        entry.queued = 0

    def _reasons(self) -> str:
        now = time.monotonic()
        return "; ".join(f"rank {r.index}: {r.explain(now)}" for r in self.ranks if not self._usable(r)) or "none"

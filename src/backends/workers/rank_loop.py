"""The loop a rank process runs: drain every command waiting (without blocking), step while the engine (or, in
lockstep, the group) has work, send ONE message per step to each dispatcher with outputs in it, and wait for
commands only when there is nothing to do.

Lockstep (DeepInfer DP > 1): ``has_unfinished_requests``, ``step`` and ``close`` are collectives, so the loop makes
the same sequence of calls on every rank: while any rank has work every rank steps (an idle rank's step is a
placeholder); a rank waits on its inbox only after the group agreed it is idle, and then only for
``IDLE_POLL_SECONDS`` before asking the group again, so no rank ever sits in its inbox while another is inside a
collective. Stopping is agreed by a MAX all-reduce taken only while the group is idle, so every rank calls
``close`` in the same iteration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, InvalidRequestError, OverloadedError
from backends.workers import messages as m
from backends.workers.dispatchers import Dispatcher, route_to_dispatchers
from backends.workers.spec import RankEngine, WorkerSpec

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.05
"""Lockstep: how long an idle rank waits on its inbox before the group's next ``has_unfinished_requests``. The
dispatcher wakes its local ranks at once when it sends work, so this bounds only the latency of work arriving
at another node's ranks."""
HEARTBEAT_SECONDS = 1.0
"""An idle worker reports at least this often, so the dispatcher can tell a silent rank from a dead one."""
REPORT_SECONDS = 0.5
"""Steps that produce no output (placeholders) send their counters at most this often."""
SAMPLES_SECONDS = 1.0
"""The engine's own ``metric_samples()`` are read and sent at most this often."""


class _Counters:
    """The worker's running totals; sent as ``RankStats``."""

    __slots__ = ("busy", "engine_seconds", "rate", "rate_start", "rate_steps", "samples", "samples_at", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.busy = 0.0
        self.engine_seconds = 0.0
        self.rate = 0.0
        self.rate_steps = 0
        self.rate_start = time.perf_counter()
        self.samples: list[list[Any]] | None = None
        self.samples_at = 0.0


class Worker:
    """The rank's loop; see the module docstring for the lockstep rules it keeps.

    The socket is a ROUTER: any number of dispatchers connect, each under its own ZeroMQ routing id. Each is known
    from its ``RESET`` hello on; its requests run under its own prefix, its outputs and errors go back to it alone,
    and every message it receives carries what the rank holds for the others (``RankLoad``). A dispatcher silent
    for ``lease_seconds`` (killed, or a host gone) loses its lease: its requests are aborted."""

    def __init__(self, spec: WorkerSpec, socket: zmq.Socket, rank_engine: RankEngine) -> None:
        self.spec = spec
        self.socket = socket
        route_to_dispatchers(socket)
        socket.setsockopt(zmq.SNDTIMEO, int(spec.lease_seconds * 1000))
        self.engine = rank_engine.engine
        self.group = rank_engine.group
        self.lockstep = spec.lockstep
        if self.lockstep and self.group is None:
            raise ValueError("lockstep needs the factory to return the rank's DataParallelGroup")
        self.dispatchers: dict[bytes, Dispatcher] = {}
        self.owner: dict[str, tuple[Dispatcher, str]] = {}  # engine request id -> its dispatcher and its own id
        self.queued: dict[str, int] = {}  # engine request id -> prompt tokens until its first output
        self.queued_total = 0
        self.tokens = 0
        self.dispatched = 0
        self.counters = _Counters()
        self.max_num_seqs = int(getattr(self.engine, "max_num_seqs", 0) or 0)
        self._stop = False
        self._aborts: list[str] = []
        self._errors: list[tuple[Dispatcher, list[Any]]] = []
        self._sessions = 0
        self._lease_checked = 0.0

    @property
    def live(self) -> set[str]:
        """Engine request ids the rank holds, for every dispatcher."""
        return set(self.owner)

    def info(self) -> list[Any]:
        engine = self.engine
        return list(
            m.EngineInfo(
                engine.max_model_len, engine.vocab_size, self.max_num_seqs, getattr(engine, "fingerprint", None)
            )
        )

    def load_for(self, dispatcher: Dispatcher) -> list[int]:
        """What the rank holds for the other dispatchers (``RankLoad``)."""
        return [len(self.owner) - len(dispatcher.live), self.queued_total - dispatcher.queued]

    def send(self, identity: bytes, message: list[Any], *, block: bool = True) -> bool:
        """Sends a message to one dispatcher; by default waits while its queue is full
        (``messages.QUEUE_MESSAGES``), so a step's outputs are never dropped: the engine pauses instead. A dispatcher
        that has not read for ``lease_seconds``, or is gone, loses its lease (its requests are aborted). False if
        the message was not sent."""
        try:
            self.socket.send_multipart([identity, m.pack(message)], 0 if block else zmq.NOBLOCK)
            return True
        except zmq.Again:
            if block:
                self._evict(identity, "did not read for its lease")
            return False  # non-blocking: a heartbeat is redundant while the queue is full of messages
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._evict(identity, "disconnected")
            return False

    def broadcast(self, message: list[Any]) -> None:
        for dispatcher in list(self.dispatchers.values()):
            self.send(dispatcher.identity, message, block=False)

    def run(self) -> None:
        engine = self.engine
        clock = time.perf_counter
        counters = self.counters
        needs_flush = False
        aborted_all = False
        awake = clock()
        while True:
            self._drain()
            if self._stop and not aborted_all:
                self._aborts.extend(self.owner)
                aborted_all = True
            if awake - self._lease_checked >= HEARTBEAT_SECONDS:
                self._check_leases(awake)
            if self._aborts:
                engine.abort_request(self._aborts)
                for engine_id in self._aborts:
                    self._drop(engine_id)
                self._aborts = []
            if self._stop and not self.lockstep:
                break
            behind = self._behind()
            if behind is not None:
                # Credits: the dispatcher has not taken the last STEPS_AHEAD steps' outputs. Stepping on would make
                # tokens nobody reads yet (and that an abort on its way would waste): wait for it, as the
                # in-process engine waits for its event loop. In lockstep the peers wait in their next collective.
                now = clock()
                counters.busy += now - awake
                self._wait_for(behind, now)
                awake = clock()
                continue
            before = clock()
            outputs: Sequence[EngineOutput]
            if engine.has_unfinished_requests():
                outputs = engine.step()
                counters.steps += 1
                needs_flush = True
            elif needs_flush:
                outputs = engine.flush_inflight_reqs()
                needs_flush = False
            else:
                now = clock()
                counters.busy += now - awake
                if self._errors:
                    self._report((), now)
                if self.lockstep:
                    assert self.group is not None
                    if self.group.all_reduce_max(int(self._stop), "agree_stop"):
                        break
                    self.socket.poll(int(IDLE_POLL_SECONDS * 1000))
                else:
                    self.socket.poll(int(HEARTBEAT_SECONDS * 1000))
                awake = clock()
                self._heartbeats(awake)
                continue
            now = clock()
            counters.engine_seconds += now - before
            counters.busy += now - awake
            awake = now
            self._report(outputs, now)
        engine.close()
        self.broadcast([m.CLOSED])

    def _behind(self) -> Dispatcher | None:
        for dispatcher in self.dispatchers.values():
            if dispatcher.behind:
                return dispatcher
        return None

    def _wait_for(self, dispatcher: Dispatcher, now: float) -> None:
        """Waits (at most a heartbeat) for a message, such as the dispatcher's credit; one that has not taken its
        outputs for ``lease_seconds`` loses its lease, so a stalled front end holds the others up that long at most."""
        if dispatcher.behind_since is None:
            dispatcher.behind_since = now
        waited = now - dispatcher.behind_since
        if waited >= self.spec.lease_seconds:
            self._evict(dispatcher.identity, f"did not take its outputs for {waited:.1f} s")
            return
        self.socket.poll(int(1000 * min(HEARTBEAT_SECONDS, self.spec.lease_seconds - waited)) + 1)
        self._heartbeats(time.perf_counter())

    def _heartbeats(self, now: float) -> None:
        """Dispatchers that have heard nothing for a heartbeat hear that the rank is alive (while idle or waiting)."""
        stats: list[Any] | None = None
        for dispatcher in list(self.dispatchers.values()):
            if dispatcher.prefixes or now - dispatcher.last_report >= HEARTBEAT_SECONDS:
                stats = stats or self._stats(now)
                message = [m.HEARTBEAT, stats, self.load_for(dispatcher), dispatcher.take_prefixes()]
                self.send(dispatcher.identity, message, block=False)
                dispatcher.last_report = now

    def _drain(self) -> None:
        socket = self.socket
        while True:
            try:
                identity, data = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = m.unpack_command(data)
            kind = message[0]
            dispatcher = self.dispatchers.get(identity)
            if kind == m.RESET:
                self.hello(identity)
            elif kind == m.STOP:
                self._stop = True
            elif dispatcher is None:
                # A dispatcher this incarnation does not know (it restarted, or the lease ran out): its commands
                # belong to requests it must fail; READY tells it so, and it says hello again.
                self.send(identity, [m.READY, os.getpid(), self.info(), self.spec.launch], block=False)
            elif kind == m.BATCH:
                dispatcher.last_seen = time.perf_counter()
                for request_id, params, prompt, user_id, prefix, *images in message[1]:
                    self._add(dispatcher, request_id, params, prompt, user_id, prefix, m.images_of(images))
                prefix = dispatcher.prefix
                owner = self.owner
                self._aborts.extend(e for e in (prefix + r for r in message[2]) if e in owner)
                if message[3] != dispatcher.taken:
                    dispatcher.taken = message[3]
                    dispatcher.behind_since = None
            elif kind == m.PING:
                dispatcher.last_seen = time.perf_counter()

    def hello(self, identity: bytes) -> None:
        """A dispatcher's session starts (again: whatever it held here is aborted), answered with ``READY``."""
        known = self.dispatchers.get(identity)
        if known is not None:
            self._aborts.extend(known.live)
            self._forget_dispatcher(known)
        self._sessions += 1
        self.dispatchers[identity] = Dispatcher(identity, f"{self._sessions}/", time.perf_counter())
        self.send(identity, [m.READY, os.getpid(), self.info(), self.spec.launch])

    def stop(self) -> None:
        """Abort everything and close the engine (with the group, in lockstep), as a ``STOP`` asks."""
        self._stop = True

    def _check_leases(self, now: float) -> None:
        self._lease_checked = now
        for dispatcher in list(self.dispatchers.values()):
            if now - dispatcher.last_seen > self.spec.lease_seconds:
                self._evict(dispatcher.identity, f"silent for {now - dispatcher.last_seen:.1f} s")

    def _evict(self, identity: bytes, reason: str) -> None:
        """The dispatcher is gone: abort its requests (in this iteration) and forget it."""
        dispatcher = self.dispatchers.pop(identity, None)
        if dispatcher is None:
            return
        logger.warning("dispatcher %s %s: aborting its %d requests", identity.hex(), reason, len(dispatcher.live))
        self._aborts.extend(dispatcher.live)
        self._forget_dispatcher(dispatcher)

    def _forget_dispatcher(self, dispatcher: Dispatcher) -> None:
        self.dispatchers.pop(dispatcher.identity, None)
        self._errors = [(d, e) for d, e in self._errors if d is not dispatcher]

    def _drop(self, engine_id: str) -> None:
        entry = self.owner.pop(engine_id, None)
        if entry is None:
            return
        dispatcher = entry[0]
        dispatcher.live.discard(engine_id)
        queued = self.queued.pop(engine_id, 0)
        dispatcher.queued -= queued
        self.queued_total -= queued

    def _add(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        params: dict[str, Any],
        prompt: bytes,
        user_id: str,
        prefix: bytes,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> None:
        if self._stop:
            return
        engine_id = dispatcher.prefix + request_id
        if engine_id in self.owner:
            self._errors.append((dispatcher, [request_id, "invalid_request", "duplicate engine request id"]))
            return
        try:
            sequence = self.engine.add_request(
                user_id=user_id,
                request_id=engine_id,
                sampling_params=params,
                prompt_token_ids=np.frombuffer(prompt, dtype=np.int32).copy(),
                multi_modal_data=multi_modal_data,
            )
        except (ValueError, TypeError, KeyError) as exc:
            self._errors.append(
                (dispatcher, [request_id, "invalid_request", f"the engine rejected the request: {exc}"])
            )
            return
        except BackendError as exc:  # an engine binding's verdict on this one request
            kind = "overloaded" if isinstance(exc, OverloadedError) else "upstream"
            kind = "invalid_request" if isinstance(exc, InvalidRequestError) else kind
            self._errors.append((dispatcher, [request_id, kind, exc.message]))
            return
        if sequence is None:
            error = [request_id, "invalid_request", "the prompt contains token ids outside the vocabulary"]
            self._errors.append((dispatcher, error))
            return
        self.owner[engine_id] = (dispatcher, request_id)
        self.dispatched += 1
        if prefix:
            for other in self.dispatchers.values():
                if other is not dispatcher:
                    other.prefixes.append(prefix)
        dispatcher.live.add(engine_id)
        tokens = len(prompt) // 4
        self.queued[engine_id] = tokens
        dispatcher.queued += tokens
        self.queued_total += tokens

    def _report(self, outputs: Sequence[EngineOutput], now: float) -> None:
        """One message per dispatcher with outputs or errors in this step; the others hear the rank's counters and
        load at most every ``REPORT_SECONDS``."""
        owner = self.owner
        queued = self.queued
        routed: dict[Dispatcher, list[tuple[Any, ...]]] = {}
        for out in outputs:
            engine_id = out.request_id
            entry = owner.get(engine_id)
            if entry is None:
                continue  # aborted meanwhile
            dispatcher, request_id = entry
            tokens = queued.pop(engine_id, None)
            if tokens is not None:
                dispatcher.queued -= tokens
                self.queued_total -= tokens
            if out.finished:
                del owner[engine_id]
                dispatcher.live.discard(engine_id)
            batch = routed.get(dispatcher)
            record = (request_id, *out[1:])
            if batch is None:
                routed[dispatcher] = [record]
            else:
                batch.append(record)
        errors: dict[Dispatcher, list[list[Any]]] = {}
        for dispatcher, error in self._errors:
            errors.setdefault(dispatcher, []).append(error)
        self._errors = []
        self.tokens += len(outputs)
        stats: list[Any] | None = None
        for dispatcher in list(self.dispatchers.values()):
            batch = routed.get(dispatcher)
            failed = errors.get(dispatcher)
            if batch is None and failed is None:
                if not dispatcher.prefixes and now - dispatcher.last_report < REPORT_SECONDS:
                    continue
            else:
                dispatcher.sent += 1  # one credit spent
            stats = stats or self._stats(now)
            load = self.load_for(dispatcher)
            message = [m.STEP, dispatcher.sent, batch or (), failed or (), stats, load, dispatcher.take_prefixes()]
            if self.send(dispatcher.identity, message):
                dispatcher.last_report = now

    def _stats(self, now: float) -> list[Any]:
        counters = self.counters
        elapsed = now - counters.rate_start
        if elapsed >= 1.0:
            counters.rate = (counters.steps - counters.rate_steps) / elapsed
            counters.rate_steps = counters.steps
            counters.rate_start = now
        samples_of = getattr(self.engine, "metric_samples", None)
        samples = None
        if samples_of is not None and now - counters.samples_at >= SAMPLES_SECONDS:
            samples = [list(s) for s in samples_of()]
            counters.samples_at = now
        unfinished = self.engine.get_num_unfinished_requests()
        kv_usage = min(unfinished, self.max_num_seqs) / self.max_num_seqs if self.max_num_seqs else 0.0
        return list(
            m.RankStats(
                counters.steps,
                self.tokens,
                counters.busy,
                counters.engine_seconds,
                unfinished,
                kv_usage,
                counters.rate,
                samples,
                len(self.owner),
                self.queued_total,
                self.dispatched,
            )
        )

"""One data-parallel rank: a process that owns one engine and drives it, fed by the dispatcher over ZeroMQ.

Run as ``python -m backends.workers.worker SPEC_JSON`` (the gateway does this for local ranks; a remote host's
supervisor does it for remote ones). The main thread constructs the engine, binds one DEALER socket and loops:
drain every command waiting (without blocking), step while the engine (or, in lockstep, the group) has work, send
ONE message per step with every output of that step, and wait for commands only when there is nothing to do.

Lockstep (DeepInfer DP > 1): ``has_unfinished_requests``, ``step`` and ``close`` are collectives, so the loop makes
the same sequence of calls on every rank: while any rank has work every rank steps (an idle rank's step is a
placeholder); a rank waits on its inbox only after the group agreed it is idle, and then only for
``IDLE_POLL_SECONDS`` before asking the group again, so no rank ever sits in its inbox while another is inside a
collective. Stopping is agreed by a MAX all-reduce taken only while the group is idle, so every rank calls
``close`` in the same iteration.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zmq

from backends.engine.protocol import Engine, EngineOutput
from backends.errors import BackendError, InvalidRequestError, OverloadedError
from backends.workers import messages as m
from backends.workers.collective import DataParallelGroup

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


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker process needs, passed as one JSON argument."""

    rank: int
    size: int
    endpoint: str  # the worker binds here; the dispatcher connects
    factory: str  # "module:function" returning a RankEngine for a RankContext
    options: dict[str, Any] = field(default_factory=dict)  # the factory's own configuration (JSON)
    lockstep: bool = False
    collective_endpoint: str | None = None  # lockstep: where rank 0 hosts the group's rendezvous
    parent_pid: int | None = None  # exit with the gateway that started us (None: started by someone else)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__slots__})  # type: ignore[attr-defined]

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class RankContext:
    """What an engine factory is told about the rank it builds."""

    rank: int
    size: int
    lockstep: bool
    collective_endpoint: str | None
    options: dict[str, Any]


class RankEngine(NamedTuple):
    """A factory's product: the engine, and in lockstep mode the group the ranks use to agree on stopping."""

    engine: Engine
    group: DataParallelGroup | None = None


RankEngineFactory = Callable[[RankContext], RankEngine]


def load_factory(path: str) -> RankEngineFactory:
    module, _, name = path.partition(":")
    factory = getattr(importlib.import_module(module), name)
    return factory  # type: ignore[no-any-return]


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
    """The rank's loop; see the module docstring for the lockstep rules it keeps."""

    def __init__(self, spec: WorkerSpec, socket: zmq.Socket, rank_engine: RankEngine) -> None:
        self.spec = spec
        self.socket = socket
        self.engine = rank_engine.engine
        self.group = rank_engine.group
        self.lockstep = spec.lockstep
        if self.lockstep and self.group is None:
            raise ValueError("lockstep needs the factory to return the rank's DataParallelGroup")
        self.live: set[str] = set()
        self.tokens = 0
        self.counters = _Counters()
        self.max_num_seqs = int(getattr(self.engine, "max_num_seqs", 0) or 0)
        self._stop = False
        self._aborts: list[str] = []
        self._errors: list[list[Any]] = []
        self._last_report = 0.0

    def info(self) -> list[Any]:
        engine = self.engine
        return list(
            m.EngineInfo(
                engine.max_model_len, engine.vocab_size, self.max_num_seqs, getattr(engine, "fingerprint", None)
            )
        )

    def send(self, message: list[Any], *, block: bool = True) -> None:
        """Sends a message; by default waits while the dispatcher's queue is full (``messages.QUEUE_MESSAGES``) or
        no dispatcher is connected, so a step's outputs are never dropped: the engine pauses instead. A dispatcher
        that left took its requests with it; the next one receives what waited here, drops outputs of requests it
        does not know, and sends RESET."""
        if block:
            self.socket.send(m.pack(message))
            return
        with contextlib.suppress(zmq.Again):  # a heartbeat is redundant while the queue is full of messages
            self.socket.send(m.pack(message), zmq.NOBLOCK)

    def run(self) -> None:
        # Announce ourselves once a dispatcher is connected: one that reconnected to a restarted remote rank learns
        # of the new incarnation from this (a fresh dispatcher sends RESET, answered with READY as well).
        while not self.socket.poll(int(HEARTBEAT_SECONDS * 1000), zmq.POLLOUT):
            pass
        self.send([m.READY, os.getpid(), self.info()])
        engine = self.engine
        clock = time.perf_counter
        counters = self.counters
        needs_flush = False
        aborted_all = False
        awake = clock()
        while True:
            self._drain()
            if self._stop and not aborted_all:
                self._aborts.extend(self.live)
                aborted_all = True
            if self._aborts:
                engine.abort_request(self._aborts)
                self.live.difference_update(self._aborts)
                self._aborts = []
            if self._stop and not self.lockstep:
                break
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
                if awake - self._last_report >= HEARTBEAT_SECONDS:
                    self.send([m.HEARTBEAT, self._stats(awake)], block=False)
                    self._last_report = awake
                continue
            now = clock()
            counters.engine_seconds += now - before
            counters.busy += now - awake
            awake = now
            if outputs or self._errors or now - self._last_report >= REPORT_SECONDS:
                self._report(outputs, now)
        engine.close()
        self.send([m.CLOSED], block=False)

    def _drain(self) -> None:
        socket = self.socket
        while True:
            try:
                data = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = m.unpack_command(data)
            kind = message[0]
            if kind == m.BATCH:
                for request_id, params, prompt, user_id in message[1]:
                    self._add(request_id, params, prompt, user_id)
                self._aborts.extend(message[2])
            elif kind == m.RESET:
                self._aborts.extend(self.live)
                self.send([m.READY, os.getpid(), self.info()])
            elif kind == m.STOP:
                self._stop = True

    def _add(self, request_id: str, params: dict[str, Any], prompt: bytes, user_id: str) -> None:
        if self._stop:
            return
        try:
            sequence = self.engine.add_request(
                user_id=user_id,
                request_id=request_id,
                sampling_params=params,
                prompt_token_ids=np.frombuffer(prompt, dtype=np.int32).copy(),
                multi_modal_data=None,
            )
        except (ValueError, TypeError, KeyError) as exc:
            self._errors.append([request_id, "invalid_request", f"the engine rejected the request: {exc}"])
            return
        except BackendError as exc:  # an engine binding's verdict on this one request
            kind = "overloaded" if isinstance(exc, OverloadedError) else "upstream"
            kind = "invalid_request" if isinstance(exc, InvalidRequestError) else kind
            self._errors.append([request_id, kind, exc.message])
            return
        if sequence is None:
            self._errors.append([request_id, "invalid_request", "the prompt contains token ids outside the vocabulary"])
            return
        self.live.add(request_id)

    def _report(self, outputs: Sequence[EngineOutput], now: float) -> None:
        live = self.live
        for out in outputs:
            if out.finished:
                live.discard(out.request_id)
        self.tokens += len(outputs)
        self.send([m.STEP, outputs, self._errors, self._stats(now)])  # records pack as arrays
        self._errors = []
        self._last_report = now

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
            )
        )


def _die_with_parent(parent_pid: int) -> None:
    """A gateway killed hard must not leave engines holding GPUs: ask Linux to SIGKILL us when it goes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        logger.warning("cannot set PR_SET_PDEATHSIG; the worker may outlive a killed gateway")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(args[0])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s dp-rank-{spec.rank} %(levelname)s %(message)s")
    if spec.parent_pid is not None:
        _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the gateway stops us
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    m.bound_queues(socket)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.bind(spec.endpoint)
    context_for_factory = RankContext(spec.rank, spec.size, spec.lockstep, spec.collective_endpoint, spec.options)
    try:
        rank_engine = load_factory(spec.factory)(context_for_factory)
        Worker(spec, socket, rank_engine).run()
    except BaseException as exc:
        logger.exception("data-parallel rank %d failed", spec.rank)
        with contextlib.suppress(zmq.ZMQError):
            socket.send(m.pack([m.FAILED, repr(exc)]), zmq.NOBLOCK)
        socket.close(linger=1000)
        return 1
    socket.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

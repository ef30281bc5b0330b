"""Drives N engine ranks in worker processes, with the same surface as ``EngineDriver`` so ``EngineBackend`` serves
from them unchanged.

Everything runs on the event loop, without threads: one ZeroMQ DEALER per rank (connected to the worker's bound
endpoint, read through ``loop.add_reader``), one pidfd per local worker process to learn of its exit at once.
``add``/``abort`` queue commands per rank and one ``call_soon`` flushes them as ONE message per rank per loop
iteration; each worker step arrives as ONE message whose outputs go to the request sinks, as the in-process driver
does per step. Load (outstanding requests, queued prompt tokens) is kept here, from what was sent and from the
first output of each request (its prefill is done), so choosing a rank costs no round trip.

Failure: a rank that exits, reports ``FAILED`` or falls silent fails its in-flight requests with an
``UpstreamError`` and is restarted with exponential backoff while the other ranks serve. In lockstep mode a
dead rank leaves its peers blocked inside a collective, so the whole group is killed, its requests failed, and
restarted together once every old process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import zmq
from tokenizers import Tokenizer

from backends.engine.driver import DriverStats, Sink
from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, InvalidRequestError, OverloadedError, UnavailableError, UpstreamError
from backends.workers import messages as m
from backends.workers.balancer import RankBalancer
from backends.workers.worker import WorkerSpec

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 15.0
"""How long ``stop()`` waits for workers to close their engines before killing them."""
HEARTBEAT_CHECK_SECONDS = 1.0
_UINT64 = 0xFFFF_FFFF_FFFF_FFFF


@dataclass
class WorkerPlan:
    """Where the ranks run and how a worker builds its engine (``factory`` is ``module:function``)."""

    size: int
    factory: str
    options: dict[str, Any] = field(default_factory=dict)
    lockstep: bool = False
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    remote_endpoints: list[str] = field(default_factory=list)
    """Ranks started elsewhere (``tcp://host:port`` each, one per rank): connected to, never spawned or killed."""
    rank_env: Callable[[int], dict[str, str]] | None = None
    """Extra environment per local rank (e.g. its GPUs)."""
    restart_backoff: float = 0.5
    max_backoff: float = 30.0
    stable_seconds: float = 30.0
    """A rank up this long has its backoff reset."""
    heartbeat_timeout: float = 10.0
    """A rank silent this long is declared dead (workers report at least every second, and after each step)."""


class _Entry:
    """One engine request in flight: where its outputs go and which rank holds it."""

    __slots__ = ("index", "queued", "rank", "sink")

    def __init__(self, sink: Sink, index: int, rank: int, queued: int) -> None:
        self.sink = sink
        self.index = index
        self.rank = rank
        self.queued = queued  # prompt tokens not yet prefilled (0 after the first output)


class RankState:
    """The dispatcher's view of one rank; read by metrics and tests."""

    def __init__(self, index: int, endpoint: str, remote: bool) -> None:
        self.index = index
        self.endpoint = endpoint
        self.remote = remote
        self.state: Literal["down", "starting", "up"] = "down"
        self.process: subprocess.Popen[bytes] | None = None
        self.exited: asyncio.Future[int] | None = None
        self.socket: zmq.Socket | None = None
        self.pid: int | None = None
        self.info: m.EngineInfo | None = None
        self.requests: set[str] = set()
        self.queued_tokens = 0
        self.adds: list[list[Any]] = []
        self.aborts: list[str] = []
        self.stats: m.RankStats | None = None
        self.samples: Sequence[Sequence[Any]] = ()  # the engine's own metric_samples(), as last reported
        self.base = DriverStats()  # totals of earlier incarnations, so counters never go back
        self.dispatched = 0
        self.restarts = 0
        self.failures_in_a_row = 0
        self.reason = "not started"
        self.up_since = 0.0
        self.last_heard = 0.0

    def report(self, stats: m.RankStats) -> None:
        self.stats = stats
        if stats.samples is not None:  # sent about once a second, not with every step
            self.samples = stats.samples

    @property
    def outstanding(self) -> int:
        return len(self.requests)

    def totals(self) -> DriverStats:
        s = self.stats
        b = self.base
        if s is None:
            return DriverStats(b.steps, b.tokens, b.busy_seconds, b.engine_seconds)
        return DriverStats(
            b.steps + s.steps, b.tokens + s.tokens, b.busy_seconds + s.busy_seconds, b.engine_seconds + s.engine_seconds
        )

    def fold(self) -> None:
        self.base = self.totals()
        self.stats = None
        self.samples = ()


class RankedEngineView:
    """What ``EngineBackend`` reads from ``driver.engine``: the tokenizer (loaded here) and the ranks' limits."""

    def __init__(self, tokenizer: Tokenizer, info: m.EngineInfo, driver: DataParallelDriver) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.fingerprint = info.fingerprint
        self._driver = driver

    def get_num_unfinished_requests(self) -> int:
        """Requests some rank still holds, as the dispatcher knows them."""
        return self._driver.in_flight

    def metric_samples(self) -> tuple[()]:
        return ()  # per-rank statistics are metric families with a rank label (``DataParallelBackend``)


class DataParallelDriver:
    """N ranks behind one add/abort/sink surface; see the module docstring."""

    def __init__(
        self,
        name: str,
        plan: WorkerPlan,
        load_tokenizer: Callable[[], Tokenizer],
        balancer: RankBalancer | None = None,
    ) -> None:
        if plan.size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if plan.remote_endpoints and len(plan.remote_endpoints) != plan.size:
            raise ValueError("worker_endpoints must name one endpoint per data-parallel rank")
        self.name = name
        self.plan = plan
        self._load_tokenizer = load_tokenizer
        self.balancer = balancer or RankBalancer(plan.size)
        self.engine: RankedEngineView | None = None
        self.ranks: list[RankState] = []
        self._sinks: dict[str, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context | None = None
        self._run_dir: str | None = None
        self._flush_pending = False
        self._started: asyncio.Future[None] | None = None
        self._stopping = False
        self._restart: asyncio.TimerHandle | None = None
        self._restart_due = 0.0
        self._generation = 0
        self._heartbeat: asyncio.TimerHandle | None = None
        self._last_prompt: np.ndarray | None = None
        self._last_rank = -1

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
    def alive(self) -> bool:
        return self.engine is not None and not self._stopping and any(self._usable(r) for r in self.ranks)

    @property
    def failure(self) -> str | None:
        """Why no rank can serve, once started (``None`` while at least one can, or before the first start)."""
        if self.engine is None or self._stopping or self.alive:
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
        """Starts every rank and returns when all are up; raises (and cleans up) if any fails to start."""
        self._loop = loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        self._run_dir = tempfile.mkdtemp(prefix="dp-")
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer))
        self.ranks = [
            RankState(i, endpoint, bool(self.plan.remote_endpoints)) for i, endpoint in enumerate(self._endpoints())
        ]
        self._started = loop.create_future()
        try:
            self._launch_all()
            await self._started
            tokenizer = await tokenizer_task
        except BaseException:
            tokenizer_task.cancel()
            await self.stop()
            raise
        info = self.ranks[0].info
        assert info is not None
        self.engine = RankedEngineView(tokenizer, info, self)
        self._heartbeat = loop.call_later(HEARTBEAT_CHECK_SECONDS, self._check_heartbeats)

    async def stop(self) -> None:
        """Fails outstanding requests, has every local rank close its engine (together, in lockstep), reaps them."""
        self._stopping = True
        for handle in (self._restart, self._heartbeat):
            if handle is not None:
                handle.cancel()
        for request_id in list(self._sinks):
            self._fail(request_id, UnavailableError(f"backend {self.name!r} is shutting down"))
        for rank in self.ranks:
            if rank.socket is not None:
                self._send(rank, [m.RESET] if rank.remote else [m.STOP])
        waiting = [r.exited for r in self.ranks if r.exited is not None and not r.exited.done()]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=STOP_TIMEOUT_SECONDS)
            if late:
                for rank in self.ranks:
                    if rank.process is not None and rank.process.poll() is None:
                        logger.warning("rank %d of %s did not stop in time; killing it", rank.index, self.name)
                        rank.process.kill()
                await asyncio.wait(late, timeout=STOP_TIMEOUT_SECONDS)
        for rank in self.ranks:
            self._close_socket(rank)
            rank.state = "down"
            rank.reason = "stopped"
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def add(
        self,
        request_id: str,
        sampling_params: dict[str, Any],
        prompt_token_ids: np.ndarray,
        sink: Sink,
        index: int,
        user_id: str = "",
    ) -> None:
        if not self.alive:
            raise UnavailableError(f"backend {self.name!r} has no rank up: {self._reasons()}", retry_after=1.0)
        rank = self._choose(prompt_token_ids)
        seed = sampling_params.get("seq_seed")
        if seed is not None:
            sampling_params = {**sampling_params, "seq_seed": seed & _UINT64}  # DeepInfer's own wrap-around
        queued = len(prompt_token_ids)
        self._sinks[request_id] = _Entry(sink, index, rank.index, queued)
        rank.requests.add(request_id)
        rank.queued_tokens += queued
        rank.dispatched += 1
        rank.adds.append([request_id, sampling_params, prompt_token_ids.tobytes(), user_id])
        self._schedule_flush()

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

    def _choose(self, prompt: np.ndarray) -> RankState:
        # The n choices of one request share its prompt array: keep them on one rank (one prefill, one cache).
        if prompt is self._last_prompt and self._usable(self.ranks[self._last_rank]):
            return self.ranks[self._last_rank]
        balancer = self.balancer
        loads = [balancer.load(r.outstanding, r.queued_tokens) for r in self.ranks]
        index = balancer.choose(prompt, loads, [self._usable(r) for r in self.ranks])
        self._last_prompt = prompt
        self._last_rank = index
        return self.ranks[index]

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        sent: list[RankState] = []
        added = False
        for rank in self.ranks:
            if not (rank.adds or rank.aborts):
                continue
            if rank.socket is not None:
                self._send(rank, [m.BATCH, rank.adds, rank.aborts])
                sent.append(rank)
                added = added or bool(rank.adds)
            rank.adds = []
            rank.aborts = []
        if added and self.plan.lockstep:
            # Idle ranks wait on their inbox between the group's has_unfinished_requests calls: wake them now,
            # so the rank given work does not wait in the collective for the others' poll timeout.
            for rank in self.ranks:
                if rank not in sent and rank.socket is not None:
                    self._send(rank, [m.BATCH, [], []])

    def _send(self, rank: RankState, message: list[Any]) -> None:
        socket = rank.socket
        assert socket is not None and self._loop is not None
        try:
            socket.send(m.pack(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unbounded queue: only a broken socket gets here
            logger.error("cannot send to rank %d of %s: %s", rank.index, self.name, exc)
        # ZeroMQ's descriptor is edge-triggered and any operation may consume its edge: reading ZMQ_EVENTS re-arms
        # it, and tells whether messages are already waiting that no edge will announce.
        if socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._on_readable, rank.index)

    # ---- receiving -------------------------------------------------------------------------------------------------

    def _on_readable(self, index: int) -> None:
        rank = self.ranks[index]
        socket = rank.socket
        while socket is not None and rank.socket is socket:
            try:
                data = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            rank.last_heard = time.monotonic()
            message = m.unpack_event(data)
            kind = message[0]
            if kind == m.STEP:
                rank.report(m.RankStats(*message[3]))
                self._dispatch(rank, message[1], message[2])
                # One step per turn: the next is read after the stream tasks this one woke have sent their frames,
                # so a rank that outruns the loop cannot bury it (and clients that leave are noticed in time).
                assert self._loop is not None
                self._loop.call_soon(self._on_readable, index)
                return
            elif kind == m.HEARTBEAT:
                rank.report(m.RankStats(*message[1]))
            elif kind == m.READY:
                self._on_ready(rank, message[1], m.EngineInfo(*message[2]))
            elif kind == m.FAILED:
                self._rank_failed(rank, f"engine failed: {message[1]}")
            elif kind == m.CLOSED:
                rank.reason = "closed"

    def _dispatch(self, rank: RankState, outputs: Sequence[tuple[Any, ...]], errors: Sequence[Any]) -> None:
        grouped: dict[str, list[tuple[Any, ...]]] = {}
        for out in outputs:
            group = grouped.get(out[0])
            if group is None:
                grouped[out[0]] = [out]
            else:
                group.append(out)
        sinks = self._sinks
        make = EngineOutput._make
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
            entry.sink(entry.index, list(map(make, group)))
        for request_id, kind, message in errors:
            self._fail(request_id, _rebuild_error(kind, message))

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

    def _on_ready(self, rank: RankState, pid: int, info: m.EngineInfo) -> None:
        if rank.state == "up" and rank.pid == pid:
            return  # the answer to our RESET after an unsolicited READY
        if rank.state == "up":  # a remote rank restarted behind the same endpoint
            self._take_down(rank, "restarted")
            self._connect(rank)
        rank.pid = pid
        rank.info = info
        rank.state = "up"
        rank.reason = ""
        rank.up_since = rank.last_heard = time.monotonic()
        logger.info("rank %d of %s is up (pid %d)", rank.index, self.name, pid)
        started = self._started
        if started is not None and not started.done() and all(r.state == "up" for r in self.ranks):
            started.set_result(None)

    # ---- processes, sockets, failure -------------------------------------------------------------------------------

    def _endpoints(self) -> list[str]:
        plan = self.plan
        if plan.remote_endpoints:
            return list(plan.remote_endpoints)
        if plan.transport == "tcp":
            return [f"tcp://{plan.host}:{_free_port(plan.host)}" for _ in range(plan.size)]
        assert self._run_dir is not None
        return [f"ipc://{self._run_dir}/rank-{i}" for i in range(plan.size)]

    def _collective_endpoint(self) -> str | None:
        plan = self.plan
        if not plan.lockstep:
            return None
        if plan.transport == "tcp":
            return f"tcp://{plan.host}:{_free_port(plan.host)}"
        return f"ipc://{self._run_dir}/collective-{self._generation}"

    def _launch_all(self) -> None:
        self._generation += 1
        collective = self._collective_endpoint()
        for rank in self.ranks:
            self._launch(rank, collective)

    def _launch(self, rank: RankState, collective: str | None) -> None:
        """Connects to the rank's endpoint (sending RESET as the hello) and, for a local rank, starts its process."""
        assert self._loop is not None
        rank.state = "starting"
        rank.reason = "starting"
        rank.pid = None
        self._connect(rank)
        if rank.remote:
            return
        plan = self.plan
        spec = WorkerSpec(
            rank.index,
            plan.size,
            rank.endpoint,
            plan.factory,
            plan.options,
            plan.lockstep,
            collective,
            os.getpid(),
        )
        env = dict(os.environ)
        if plan.rank_env is not None:
            env.update(plan.rank_env(rank.index))
        # Spawned from the event loop's thread: PR_SET_PDEATHSIG fires when the spawning *thread* exits.
        process = subprocess.Popen(
            [sys.executable, "-m", "backends.workers.worker", spec.to_json()], stdin=subprocess.DEVNULL, env=env
        )
        rank.process = process
        rank.exited = self._loop.create_future()
        self._watch_exit(rank, process, rank.exited)

    def _connect(self, rank: RankState) -> None:
        assert self._context is not None and self._loop is not None
        self._close_socket(rank)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 20)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        socket.connect(rank.endpoint)
        rank.socket = socket
        rank.last_heard = time.monotonic()
        self._loop.add_reader(socket.FD, self._on_readable, rank.index)
        self._send(rank, [m.RESET])  # queued until connected; the worker answers READY

    def _close_socket(self, rank: RankState) -> None:
        socket = rank.socket
        if socket is None:
            return
        rank.socket = None
        if self._loop is not None:
            self._loop.remove_reader(socket.FD)
        socket.close(linger=0)

    def _watch_exit(self, rank: RankState, process: subprocess.Popen[bytes], exited: asyncio.Future[int]) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): a thread waits instead
            loop.run_in_executor(None, process.wait).add_done_callback(lambda _: self._on_exit(rank, process, exited))
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._on_exit(rank, process, exited)

        loop.add_reader(pidfd, readable)

    def _on_exit(self, rank: RankState, process: subprocess.Popen[bytes], exited: asyncio.Future[int]) -> None:
        code = process.wait()
        if not exited.done():
            exited.set_result(code)
        if rank.process is not process:
            return
        rank.process = None
        if self._stopping:
            return
        reason = f"worker exited with {_describe_exit(code)}"
        if rank.state != "down":
            self._rank_failed(rank, reason)
        else:
            self._maybe_restart()

    def _rank_failed(self, rank: RankState, reason: str) -> None:
        if rank.state == "down" or self._stopping:
            return
        logger.error("rank %d of %s failed: %s", rank.index, self.name, reason)
        started = self._started
        if started is not None and not started.done():
            self._take_down(rank, reason)
            started.set_exception(RuntimeError(f"rank {rank.index} of backend {self.name!r} failed: {reason}"))
            return
        self._take_down(rank, reason)
        if self.plan.lockstep:  # its peers are blocked in a collective: the group restarts as one
            for other in self.ranks:
                if other is not rank and other.state != "down":
                    self._take_down(other, f"lockstep group restart after rank {rank.index} failed")
        plan = self.plan
        failures = max(r.failures_in_a_row for r in self.ranks)
        delay = min(plan.max_backoff, plan.restart_backoff * 2**failures)
        for r in self.ranks if plan.lockstep else [rank]:
            r.failures_in_a_row += 1
            r.reason += f"; restarting in {delay:.1f} s"
        assert self._loop is not None
        self._restart_due = max(self._restart_due, self._loop.time() + delay)
        if self._restart is None:
            self._restart = self._loop.call_at(self._restart_due, self._on_restart_timer)

    def _take_down(self, rank: RankState, reason: str) -> None:
        """Marks the rank down, fails its requests, and kills its process (if ours) so it can be replaced."""
        if time.monotonic() - rank.up_since >= self.plan.stable_seconds and rank.state == "up":
            rank.failures_in_a_row = 0
        rank.state = "down"
        rank.reason = reason
        self._close_socket(rank)
        rank.fold()
        rank.adds = []
        rank.aborts = []
        self.balancer.forget(rank.index)
        error = UpstreamError(f"data-parallel rank {rank.index} of backend {self.name!r} failed: {reason}")
        for request_id in list(rank.requests):
            self._fail(request_id, error)
        rank.queued_tokens = 0
        if rank.process is not None and rank.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                rank.process.send_signal(signal.SIGKILL)

    def _on_restart_timer(self) -> None:
        self._restart = None
        self._maybe_restart()

    def _maybe_restart(self) -> None:
        """Relaunches down ranks once their backoff passed and their old process is gone (GPU memory freed)."""
        if self._stopping or self._restart is not None or self._loop is None:
            return
        if self._loop.time() < self._restart_due:
            return
        down = [r for r in self.ranks if r.state == "down"]
        if not down:
            return
        if self.plan.lockstep:
            if any(r.process is not None for r in self.ranks):
                return  # _on_exit of the last old process calls back here
            for rank in self.ranks:
                rank.restarts += 1
            self._launch_all()
            return
        collective = None
        for rank in down:
            if rank.process is None:
                rank.restarts += 1
                self._launch(rank, collective)

    def _check_heartbeats(self) -> None:
        assert self._loop is not None
        now = time.monotonic()
        for rank in self.ranks:
            if rank.state == "up" and now - rank.last_heard > self.plan.heartbeat_timeout:
                self._rank_failed(rank, f"silent for {now - rank.last_heard:.0f} s")
        self._heartbeat = self._loop.call_later(HEARTBEAT_CHECK_SECONDS, self._check_heartbeats)

    def _reasons(self) -> str:
        return "; ".join(f"rank {r.index}: {r.reason}" for r in self.ranks if not self._usable(r)) or "none"


def _rebuild_error(kind: str, message: str) -> BackendError:
    if kind == "invalid_request":
        return InvalidRequestError(message)
    if kind == "overloaded":
        return OverloadedError(message, retry_after=1.0)
    return UpstreamError(message)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _free_port(host: str) -> int:
    """A port the kernel has free now, for a local worker to bind (tcp transport)."""
    with socketlib.socket(socketlib.AF_INET, socketlib.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])

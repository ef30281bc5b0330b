"""Carries out what ``RankSupervisor`` decides for ``DataParallelDriver``: launching ranks, connecting to them,
watching their processes exit, checking their heartbeats and taking them down.

The driver keeps the dispatch I/O (queuing, flushing, reading steps, handing outputs to sinks); this holds each
rank's lifecycle and reaches back to the driver only through four callables given at construction: ``send`` a
message to a rank, ``on_readable`` (the reader a rank's socket is watched with), ``fail`` a request, and
``schedule_flush`` commands a full queue held back. The rank list is the driver's own, shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from backends.errors import BackendError, UpstreamError
from backends.workers import messages as m
from backends.workers.balancer import RankBalancer
from backends.workers.keys import keys_for
from backends.workers.launch import RankProcess, WorkerPlan, free_port
from backends.workers.ranks import HELLO_AGAIN_MAX_SECONDS, HELLO_AGAIN_SECONDS, RankState
from backends.workers.startup import LaunchStatus
from backends.workers.supervisor import Clock, RankSupervisor, RestartPolicy

logger = logging.getLogger("backends.workers.driver")
"""The driver's logger: a rank's lifecycle is logged under the name it always was."""

HEARTBEAT_CHECK_SECONDS = 1.0


class RankLifecycle:
    """Each rank's process, socket and liveness, for one driver: the ``RankControl`` its ``RankSupervisor`` acts
    through."""

    def __init__(
        self,
        name: str,
        plan: WorkerPlan,
        identity: bytes,
        balancer: RankBalancer,
        send: Callable[[RankState, list[Any]], bool],
        on_readable: Callable[[int], None],
        fail: Callable[[str, BackendError], None],
        schedule_flush: Callable[[], None],
    ) -> None:
        self.name = name
        self.plan = plan
        self.identity = identity
        self.balancer = balancer
        self._send = send
        self._on_readable = on_readable
        self._fail = fail
        self._schedule_flush = schedule_flush
        self.ranks: list[RankState] = []
        self.stopping = False
        self.supervisor: RankSupervisor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context | None = None
        self._run_dir: str | None = None
        self._started: asyncio.Future[None] | None = None
        self._generation = 0
        self._heartbeat: asyncio.TimerHandle | None = None

    # ---- opening and closing ---------------------------------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """The ZeroMQ context and the directory of IPC endpoints, for the driver's start."""
        self._loop = loop
        self._context = zmq.Context()
        self._run_dir = tempfile.mkdtemp(prefix="dp-")

    def new_ranks(self) -> list[RankState]:
        """Every rank, not yet launched, at the endpoint it is reached at; the list is shared with the driver."""
        self.ranks = [RankState(i, self._endpoint(i), bool(self.plan.remote_endpoints)) for i in range(self.plan.size)]
        return self.ranks

    def begin(self, clock: Clock | None) -> asyncio.Future[None]:
        """Sets up the supervisor and the heartbeat; the future is done once every rank is up or has failed."""
        assert self._loop is not None
        loop = self._loop
        self._started = loop.create_future()
        plan = self.plan
        policy = RestartPolicy(plan.restart_backoff, plan.max_backoff, plan.stable_seconds, plan.start_timeout)
        self.supervisor = RankSupervisor(
            plan.size, policy, clock or loop, self, lockstep=plan.lockstep, local=not plan.remote_endpoints
        )
        # From the start on: a rank up before the others is pinged (its lease), a remote one still loading greeted.
        self._heartbeat = loop.call_later(HEARTBEAT_CHECK_SECONDS, self._check_heartbeats)
        return self._started

    def begin_stop(self) -> None:
        """No more restarts, failure reports or heartbeats: the driver is stopping."""
        self.stopping = True
        if self.supervisor is not None:
            self.supervisor.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    def close(self) -> None:
        """Closes every rank's socket, the context and the IPC directory, once the ranks are gone."""
        for rank in self.ranks:
            self.close_socket(rank)
            rank.state = "down"
            rank.reason = "stopped"
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    # ---- what a rank says of itself --------------------------------------------------------------------------------

    def on_starting(self, rank: RankState, pid: int, launch: int, after: str, delay: float) -> None:
        """The rank waits out its backoff or builds its engine; a rank we served from has restarted."""
        if rank.state == "up":
            self._take_down(rank, "restarted")
            self._connect(rank)
            rank.state = "starting"
        elif rank.state != "starting":
            return
        rank.pid = pid
        rank.launch = launch
        rank.after = after
        rank.builds_at = time.monotonic() + delay
        rank.reason = "starting"
        if after:  # its launcher restarts it after failures: the start does not wait for it
            rank.settled = True
            self._maybe_started()

    def on_ready(self, rank: RankState, pid: int, info: m.EngineInfo, launch: int) -> None:
        answer = rank.hellos > 0
        rank.hellos = max(0, rank.hellos - 1)
        if rank.state == "up" and answer:
            return  # the answer to a further RESET: one sent again while starting, or after an unsolicited READY
        if rank.state == "up":
            # Unsolicited: the rank does not know us. A new incarnation behind the same endpoint (remote ranks, or
            # ranks the front-end supervisor hosts), or it dropped us when our lease ran out: our requests are gone.
            self._take_down(rank, "restarted" if pid != rank.pid else "the rank dropped this dispatcher's lease")
            self._connect(rank)
        elif rank.state != "starting":
            return  # a late READY on a socket of a rank taken down
        rank.pid = pid
        rank.info = info
        rank.launch = launch
        rank.builds_at = None
        rank.taken = rank.credited = 0  # a new session: the rank numbers its step messages from 1 again
        rank.state = "up"
        rank.reason = ""
        rank.last_heard = time.monotonic()
        logger.info("rank %d of %s is up (pid %d)", rank.index, self.name, pid)
        assert self.supervisor is not None
        self.supervisor.ready(rank.index)
        self._maybe_started()

    def rank_failed(self, rank: RankState, reason: str) -> None:
        """Reports the failure; the supervisor takes the rank (in lockstep, the group) down and plans the restart."""
        if rank.state == "down" or self.stopping:
            return
        assert self.supervisor is not None
        self.supervisor.failed(rank.index, reason)

    # ---- processes, sockets, failure (what RankSupervisor decides, carried out: the RankControl surface) --------

    def launch(self, ranks: Sequence[int]) -> None:
        """Starts these ranks (all of them, as one new group, in lockstep)."""
        collective = None
        if self.plan.lockstep:
            self._generation += 1
            collective = self._collective_endpoint()
        for index in ranks:
            self._launch(self.ranks[index], collective)

    def take_down(self, index: int, reason: str, restart_in: float) -> None:
        rank = self.ranks[index]
        logger.error("rank %d of %s is down: %s; restarting in %.1f s", index, self.name, reason, restart_in)
        self._take_down(rank, reason)
        rank.retry_at = time.monotonic() + restart_in
        rank.settled = True
        self._maybe_started()

    def _maybe_started(self) -> None:
        """The start is over once every rank is up or has failed (and is being restarted)."""
        started = self._started
        if started is not None and not started.done() and all(r.state == "up" or r.settled for r in self.ranks):
            started.set_result(None)

    def _endpoint(self, rank: int) -> str:
        """Where a rank is reached: for a local TCP rank a port free now, chosen again at each launch (the old one
        may have been taken meanwhile; if it is taken before the worker binds, the worker exits and is relaunched
        on another)."""
        plan = self.plan
        if plan.remote_endpoints:
            return plan.remote_endpoints[rank]
        if plan.transport == "tcp":
            return f"tcp://{plan.host}:{free_port(plan.host)}"
        assert self._run_dir is not None
        return f"ipc://{self._run_dir}/rank-{rank}"

    def _collective_endpoint(self) -> str:
        if self.plan.transport == "tcp":
            return f"tcp://{self.plan.host}:{free_port(self.plan.host)}"
        return f"ipc://{self._run_dir}/collective-{self._generation}"

    def _launch(self, rank: RankState, collective: str | None) -> None:
        """Connects to the rank's endpoint (sending RESET as the hello) and, for a local rank, starts its process."""
        assert self._loop is not None
        after = rank.reason if rank.launches else ""
        rank.state = "starting"
        rank.reason = "starting"
        rank.pid = None
        rank.retry_at = rank.builds_at = None
        rank.launches += 1
        if not rank.remote:  # what we tell it; a remote rank tells us
            rank.launch, rank.after = rank.launches, after
        if not rank.remote:
            rank.endpoint = self._endpoint(rank.index)
        self._connect(rank)
        if rank.remote:
            return
        # Spawned from the event loop's thread: PR_SET_PDEATHSIG fires when the spawning *thread* exits.
        try:
            process = self.plan.spawn(rank.index, rank.endpoint, collective, LaunchStatus(rank.launches, after, 0.0))
        except OSError as exc:  # reported from the next loop iteration: the supervisor is inside its launch now
            logger.exception("cannot start rank %d of %s", rank.index, self.name)
            self._loop.call_soon(self._never_started, rank, f"cannot start its worker process: {exc}")
            return
        rank.process = process
        rank.exited = self._loop.create_future()
        self._watch_exit(rank, process, rank.exited)

    def _connect(self, rank: RankState) -> None:
        assert self._context is not None and self._loop is not None
        self.close_socket(rank)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.ROUTING_ID, self.identity)
        keys = keys_for(rank.endpoint, self.plan.keys)
        if keys is not None:
            keys.connect_as_client(socket)
        m.bound_queues(socket)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 20)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        socket.connect(rank.endpoint)
        rank.socket = socket
        rank.last_heard = time.monotonic()
        self._loop.add_reader(socket.FD, self._on_readable, rank.index)
        rank.hellos = 1
        rank.hello_at = rank.last_heard
        rank.hello_again = HELLO_AGAIN_SECONDS
        self._send(rank, [m.RESET])  # queued until connected; the worker answers READY

    def close_socket(self, rank: RankState) -> None:
        socket = rank.socket
        if socket is None:
            return
        rank.socket = None
        if self._loop is not None:
            self._loop.remove_reader(socket.FD)
        socket.close(linger=0)

    def _watch_exit(self, rank: RankState, process: RankProcess, exited: asyncio.Future[int]) -> None:
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

    def _on_exit(self, rank: RankState, process: RankProcess, exited: asyncio.Future[int]) -> None:
        reason = process.end_reason()
        if not exited.done():
            exited.set_result(process.returncode)
        if rank.process is not process:
            return
        rank.process = None
        if self.stopping:
            return
        self.rank_failed(rank, reason)
        assert self.supervisor is not None
        self.supervisor.exited(rank.index)  # its GPU memory is free: a relaunch may go ahead

    def _never_started(self, rank: RankState, reason: str) -> None:
        if self.stopping:
            return
        self.rank_failed(rank, reason)
        assert self.supervisor is not None
        self.supervisor.exited(rank.index)  # there is no process to wait for

    def _take_down(self, rank: RankState, reason: str) -> None:
        """Marks the rank down, fails its requests, and kills its process (if ours) so it can be replaced."""
        rank.state = "down"
        rank.reason = reason
        self.close_socket(rank)
        rank.forget_stats()
        rank.adds = []
        rank.aborts = []
        self.balancer.forget(rank.index)
        error = UpstreamError(f"data-parallel rank {rank.index} of backend {self.name!r} failed: {reason}")
        for request_id in list(rank.requests):
            self._fail(request_id, error)
        rank.queued_tokens = 0
        rank.others = m.RankLoad(0, 0)
        if rank.process is not None and rank.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                rank.process.send_signal(signal.SIGKILL)

    def _check_heartbeats(self) -> None:
        assert self._loop is not None
        now = time.monotonic()
        for rank in self.ranks:
            if rank.state == "up" and now - rank.last_heard > self.plan.heartbeat_timeout:
                self.rank_failed(rank, f"silent for {now - rank.last_heard:.0f} s")
                continue
            if rank.state == "up" and rank.socket is not None:
                self._send(rank, [m.PING])  # renews our lease on the rank (redundant if its queue is full)
                if rank.hellos and now - rank.hello_at > self.plan.heartbeat_timeout:
                    rank.hellos = 0  # unanswered by now: lost with an incarnation that died while loading
            elif rank.state == "starting" and rank.remote and rank.socket is not None:
                self._greet_again(rank, now)
            if rank.has_commands:
                self._schedule_flush()  # commands held back by a full queue (normally ``_on_readable`` resends)
        self._heartbeat = self._loop.call_later(HEARTBEAT_CHECK_SECONDS, self._check_heartbeats)

    def _greet_again(self, rank: RankState, now: float) -> None:
        """A rank started elsewhere may have taken our hello and died while loading; its replacement behind the same
        endpoint (our socket reconnects by itself) never heard it. So a starting remote rank is greeted again, at
        growing intervals: a rank still loading answers every RESET with READY once its engine is up."""
        if now - rank.hello_at < rank.hello_again:
            return
        if self._send(rank, [m.RESET]):
            rank.hellos += 1
        rank.hello_at = now
        rank.hello_again = min(HELLO_AGAIN_MAX_SECONDS, rank.hello_again * 2)

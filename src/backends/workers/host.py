"""Hosts a backend's rank workers for several front-end processes: started once, on endpoints that do not change,
and started again when they exit, while every front end connects to them as a dispatcher.

The front-end supervisor (``gateway/server.py``) runs this with ``server.runtime.workers > 1``: were each front end to
start its own ranks, N front ends would start N engines per rank. The front ends are handed the endpoints as
``worker_endpoints`` and treat the ranks as remote: they connect, never start or stop them, and notice a new
incarnation by its ``READY``. Synchronous on purpose: the supervisor's loop waits on process descriptors.

A rank that exits is started again at once, told its launch number, why its predecessor ended (the engine's error
from the failure pipe, or the exit status) and its backoff, which it waits out itself while answering every front
end with ``STARTING`` (``backends/workers/startup.py``): so the front ends' ``/ready`` shows why a rank is down,
how often it restarted and when it comes back, though only this process knows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

import zmq

from backends.workers import messages as m
from backends.workers.driver import STOP_TIMEOUT_SECONDS
from backends.workers.keys import keys_for
from backends.workers.launch import RankProcess, WorkerPlan, free_port
from backends.workers.startup import LaunchStatus

logger = logging.getLogger(__name__)


class _HostedRank:
    __slots__ = ("after", "delay", "due", "failures", "launches", "pidfd", "process", "started")

    def __init__(self) -> None:
        self.process: RankProcess | None = None
        self.pidfd: int | None = None
        self.started = 0.0
        self.failures = 0  # exits in a row, each within ``stable_seconds`` of its start
        self.launches = 0
        self.after = ""  # why the last incarnation ended
        self.delay = 0.0  # the next launch's backoff, which the worker waits out itself
        self.due: float | None = None  # when to try again to spawn a worker that could not be spawned


class RankHost:
    """The local ranks of one backend, for every front end; see the module docstring."""

    def __init__(self, name: str, plan: WorkerPlan, run_dir: str) -> None:
        if plan.remote_endpoints:
            raise ValueError("ranks listed in worker_endpoints are started elsewhere, not hosted")
        self.name = name
        self.plan = plan
        self.run_dir = run_dir
        self.endpoints = [self._endpoint(index) for index in range(plan.size)]
        self.ranks = [_HostedRank() for _ in range(plan.size)]
        self._generation = 0
        self._collective: str | None = None

    def _endpoint(self, index: int) -> str:
        if self.plan.transport == "tcp":
            return f"tcp://{self.plan.host}:{free_port(self.plan.host)}"
        return f"ipc://{self.run_dir}/{self.name}-rank-{index}"

    def start(self) -> None:
        self._launch_all()

    def descriptors(self) -> list[int]:
        """A pidfd per running rank: readable once it exits."""
        return [rank.pidfd for rank in self.ranks if rank.pidfd is not None]

    def timeout(self, now: float) -> float | None:
        """Seconds until the next relaunch is due (None: none pending)."""
        due = [rank.due for rank in self.ranks if rank.due is not None]
        return max(0.0, min(due) - now) if due else None

    def on_exited(self, ready: Sequence[object], now: float) -> None:
        """Reaps the ranks whose pidfd is in ``ready`` and starts them again, each waiting out its backoff (the
        whole group, in lockstep, once every old process is gone)."""
        exited = [rank for rank in self.ranks if rank.pidfd is not None and rank.pidfd in ready]
        for rank in exited:
            assert rank.process is not None
            rank.after = rank.process.end_reason()
            self._close(rank)
            rank.failures = 1 if now - rank.started >= self.plan.stable_seconds else rank.failures + 1
            rank.delay = min(self.plan.max_backoff, self.plan.restart_backoff * 2 ** (rank.failures - 1))
            logger.error(
                "rank %d of %s ended (%s); starting it again after %.1f s",
                self.ranks.index(rank),
                self.name,
                rank.after,
                rank.delay,
            )
        if not exited:
            return
        if self.plan.lockstep:
            # Its peers are blocked inside a collective: the group goes down and comes back together.
            first = exited[0]
            delay = max(rank.delay for rank in exited)
            for rank in self.ranks:
                self._kill(rank)
                if rank not in exited:
                    rank.after = f"lockstep group restart after rank {self.ranks.index(first)} ended: {first.after}"
                rank.delay = delay
            self._launch_all()
            return
        for rank in exited:
            self._launch(self.ranks.index(rank), None)

    def relaunch_due(self, now: float) -> None:
        """Tries again to spawn the workers that could not be spawned."""
        if self.plan.lockstep:
            if any(rank.due is not None and rank.due <= now for rank in self.ranks):
                for rank in self.ranks:
                    self._kill(rank)
                self._launch_all()
            return
        for index, rank in enumerate(self.ranks):
            if rank.due is not None and rank.due <= now:
                self._launch(index, None)

    def _launch_all(self) -> None:
        collective = None
        if self.plan.lockstep:
            self._generation += 1
            collective = (
                f"tcp://{self.plan.host}:{free_port(self.plan.host)}"
                if self.plan.transport == "tcp"
                else f"ipc://{self.run_dir}/{self.name}-collective-{self._generation}"
            )
        for index in range(self.plan.size):
            self._launch(index, collective)

    def _launch(self, index: int, collective: str | None) -> None:
        plan = self.plan
        rank = self.ranks[index]
        rank.due = None
        rank.launches += 1
        try:
            rank.process = plan.spawn(
                index, self.endpoints[index], collective, LaunchStatus(rank.launches, rank.after, rank.delay)
            )
        except OSError as exc:
            logger.exception("cannot start rank %d of %s", index, self.name)
            rank.after = f"cannot start its worker process: {exc}"
            rank.failures += 1
            rank.due = time.monotonic() + min(plan.max_backoff, plan.restart_backoff * 2**rank.failures)
            return
        rank.pidfd = os.pidfd_open(rank.process.pid)
        rank.started = time.monotonic()
        logger.info("rank %d of %s started (pid %d) at %s", index, self.name, rank.process.pid, self.endpoints[index])

    def _kill(self, rank: _HostedRank) -> None:
        if rank.process is not None:
            with contextlib.suppress(ProcessLookupError):
                rank.process.send_signal(signal.SIGKILL)
            rank.process.end_reason()  # reaps it and closes its failure pipe
        self._close(rank)

    @staticmethod
    def _close(rank: _HostedRank) -> None:
        if rank.pidfd is not None:
            os.close(rank.pidfd)
        rank.pidfd = None
        rank.process = None

    def stop(self) -> None:
        """Once every front end is gone: each rank closes its engine (together, in lockstep), stragglers are killed."""
        context = zmq.Context()
        try:
            for index, rank in enumerate(self.ranks):
                rank.due = None
                if rank.process is None:
                    continue
                socket = context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, int(STOP_TIMEOUT_SECONDS * 1000))
                socket.setsockopt(zmq.ROUTING_ID, b"front-end-supervisor")
                keys = keys_for(self.endpoints[index], self.plan.keys)
                if keys is not None:
                    keys.connect_as_client(socket)
                socket.connect(self.endpoints[index])
                for message in ([m.RESET], [m.STOP]):
                    with contextlib.suppress(zmq.Again):
                        socket.send(m.pack(message), zmq.NOBLOCK)
                socket.close()
            deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
            for index, rank in enumerate(self.ranks):
                if rank.process is None:
                    continue
                try:
                    rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("rank %d of %s did not stop in time; killing it", index, self.name)
                self._kill(rank)
        finally:
            context.term()

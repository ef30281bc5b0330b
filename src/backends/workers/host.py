"""Hosts a backend's rank workers for several front-end processes: started once, on endpoints that do not change,
and started again when they exit, while every front end connects to them as a dispatcher.

The front-end supervisor (``gateway/server.py``) runs this with ``server.workers > 1``: were each front end to
start its own ranks, N front ends would start N engines per rank. The front ends are handed the endpoints as
``worker_endpoints`` and treat the ranks as remote: they connect, never start or stop them, and notice a new
incarnation by its ``READY``. Synchronous on purpose: the supervisor's loop waits on process descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

import zmq

from backends.workers import messages as m
from backends.workers.driver import STOP_TIMEOUT_SECONDS, WorkerPlan, free_port

logger = logging.getLogger(__name__)


class _HostedRank:
    __slots__ = ("due", "failures", "pidfd", "process", "started")

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.pidfd: int | None = None
        self.started = 0.0
        self.failures = 0  # exits in a row, each within ``stable_seconds`` of its start
        self.due: float | None = None  # when to launch it again


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

    def on_exited(self, ready: list[object], now: float) -> None:
        """Reaps the ranks whose pidfd is in ``ready`` and plans their relaunch (the whole group, in lockstep)."""
        exited = [rank for rank in self.ranks if rank.pidfd is not None and rank.pidfd in ready]
        for rank in exited:
            assert rank.process is not None
            code = rank.process.wait()
            self._close(rank)
            rank.failures = 1 if now - rank.started >= self.plan.stable_seconds else rank.failures + 1
            delay = min(self.plan.max_backoff, self.plan.restart_backoff * 2 ** (rank.failures - 1))
            logger.error(
                "rank %d of %s exited with code %s; starting it again in %.1f s",
                self.ranks.index(rank),
                self.name,
                code,
                delay,
            )
            rank.due = now + delay
        if exited and self.plan.lockstep:
            # Its peers are blocked inside a collective: the group goes down and comes back together.
            due = max(rank.due for rank in exited if rank.due is not None)
            for rank in self.ranks:
                self._kill(rank)
                rank.due = due

    def relaunch_due(self, now: float) -> None:
        if self.plan.lockstep:
            if all(rank.due is not None and rank.due <= now for rank in self.ranks):
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
        try:
            rank.process = plan.spawn(index, self.endpoints[index], collective)
        except OSError:
            logger.exception("cannot start rank %d of %s", index, self.name)
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
            rank.process.wait()
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

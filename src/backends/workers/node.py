"""Runs one node's share of a backend's ranks for dispatchers on other hosts (``deepinfer-gateway ranks``).

A backend whose ranks span several hosts lists them all in ``worker_endpoints``; node ``k`` of ``n`` runs ranks
``k * size / n`` to ``(k + 1) * size / n - 1``, each bound at its endpoint's port on this host, and every gateway
front end connects to them as a dispatcher. The node does not restart its ranks: in a lockstep group (DeepInfer's
DP ranks meet in one torch.distributed group across the nodes) a dead rank leaves every other rank blocked in a
collective, so the group can only come back whole. When one rank fails, the node takes its others down and exits
with status 1, and whatever runs the nodes restarts the group (a LeaderWorkerSet recreates every pod of the group
when one restarts; ``deploy/kubernetes/deepinfer-multinode``). On SIGTERM the ranks close their engines (in
lockstep the whole group agrees to stop, so the other nodes' ranks close too) and the node exits with status 0.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from urllib.parse import urlsplit

import zmq

from backends.workers import messages as m
from backends.workers.driver import STOP_TIMEOUT_SECONDS
from backends.workers.keys import keys_for
from backends.workers.launch import RankProcess, WorkerPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeShare:
    """Which ranks of a ``size``-rank group node ``node`` of ``nodes`` runs: an equal, contiguous share."""

    size: int
    nodes: int = 1
    node: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or not 0 <= self.node < self.nodes:
            raise ValueError(f"node {self.node} of {self.nodes}: the node index must be in 0..{self.nodes - 1}")
        if self.size % self.nodes:
            raise ValueError(f"{self.size} ranks cannot be shared equally by {self.nodes} nodes")

    @property
    def ranks(self) -> range:
        per_node = self.size // self.nodes
        return range(self.node * per_node, (self.node + 1) * per_node)


def bind_address(endpoint: str, host: str) -> str:
    """Where this host binds a rank listed as ``endpoint``: its port on ``host`` (the name in the list is how the
    dispatchers reach it), or the same ``ipc://`` path."""
    if endpoint.startswith("ipc://"):
        return endpoint
    port = urlsplit(endpoint).port
    if port is None:
        raise ValueError(f"{endpoint!r} names no port")
    return f"tcp://{host}:{port}"


def _reachable(bound: str) -> str:
    """The bound address as a local connection reaches it (a wildcard bind is reached on the loopback)."""
    return bound.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")


class RankNode:
    """This node's ranks: started together, taken down together; see the module docstring."""

    def __init__(self, name: str, plan: WorkerPlan, ranks: Sequence[int], endpoints: Sequence[str]) -> None:
        if len(ranks) != len(endpoints):
            raise ValueError("one endpoint per rank")
        self.name = name
        self.plan = plan
        self.ranks = list(ranks)
        self.endpoints = list(endpoints)
        self.processes: list[RankProcess] = []
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = False

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._stopping = True
        os.write(self._wake_write, b"x")

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT or the group's agreed stop (0), or until a rank fails (1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        code = 1
        with tempfile.TemporaryDirectory(prefix="deepinfer-gateway-node-") as run_dir:
            # A lockstep reference group meets at an endpoint of rank 0's node; DeepInfer's ranks meet at
            # MASTER_ADDR / MASTER_PORT instead and ignore it.
            collective = f"ipc://{run_dir}/collective" if self.plan.lockstep else None
            try:
                for rank, endpoint in zip(self.ranks, self.endpoints, strict=True):
                    process = self.plan.spawn(rank, endpoint, collective)
                    self.processes.append(process)
                    logger.info("rank %d of %s started (pid %d) at %s", rank, self.name, process.pid, endpoint)
                code = self._wait()
            finally:
                # A rank gone from a lockstep group leaves its peers inside a collective: no STOP can reach them.
                self._stop(graceful=code == 0 or not self.plan.lockstep)
                os.close(self._wake_read)
                os.close(self._wake_write)
        return code

    def _wait(self) -> int:
        pidfds = {os.pidfd_open(p.pid): (rank, p) for rank, p in zip(self.ranks, self.processes, strict=True)}
        try:
            while not self._stopping:
                ready = multiprocessing.connection.wait([self._wake_read, *pidfds])
                for fd in ready:
                    if fd in pidfds:
                        rank, process = pidfds[fd]
                        code = process.wait()
                        if code == 0:  # it closed its engine: the group agreed to stop (another node's SIGTERM)
                            logger.info("rank %d of %s closed with its group", rank, self.name)
                            return 0
                        logger.error(
                            "rank %d of %s ended (%s): taking the node's ranks down so that the group restarts whole",
                            rank,
                            self.name,
                            process.end_reason(),
                        )
                        return 1
            return 0
        finally:
            for fd in pidfds:
                os.close(fd)

    def _stop(self, *, graceful: bool) -> None:
        """Asks every rank still running to close its engine (in lockstep, the group agrees), then kills stragglers;
        not ``graceful``: kills them at once."""
        running = [(e, p) for e, p in zip(self.endpoints, self.processes, strict=False) if p.poll() is None]
        if not graceful:
            for _, process in running:
                process.kill()
                process.wait()
            return
        context = zmq.Context()
        try:
            for endpoint, _ in running:
                socket = context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, int(STOP_TIMEOUT_SECONDS * 1000))
                socket.setsockopt(zmq.ROUTING_ID, b"rank-node")
                keys = keys_for(endpoint, self.plan.keys) if self.plan.keys else None
                if keys is not None:  # the node holds the ranks' key pair, which they admit too
                    keys.connect_as_client(socket)
                socket.connect(_reachable(endpoint))
                for message in ([m.RESET], [m.STOP]):
                    with contextlib.suppress(zmq.Again):
                        socket.send(m.pack(message), zmq.NOBLOCK)
                socket.close()
            deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
            for _, process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("rank pid %d of %s did not stop in time; killing it", process.pid, self.name)
                    process.kill()
                    process.wait()
        finally:
            context.term()

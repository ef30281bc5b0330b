"""A raw ZeroMQ dispatcher, a test double of ``DataParallelDriver`` that speaks the rank protocol
(``backends.workers.messages``) message by message, and rank worker processes for it to talk to.

It lets a test do what the real driver never would (never take its outputs, come without a key) and read the
rank's own counters from what the rank sends (``RankStats`` in every ``STEP`` and ``HEARTBEAT``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import zmq

from backends.config import ReferenceBackendConfig
from backends.workers import messages as m
from backends.workers.spec import WorkerSpec

FACTORY = "backends.reference.backend:build_rank_engine"
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True, "top_logprobs": 0}
PROMPT = np.arange(10, 30, dtype=np.int32).tobytes()
WAIT_MS = 60_000
"""How long a read may wait: a generous bound for a message that must come (a test that hangs fails instead)."""


def add(request_id: str, max_tokens: int) -> list[Any]:
    """A ``BATCH`` add of a request that generates ``max_tokens`` tokens."""
    return [request_id, {**PARAMS, "max_tokens": max_tokens}, PROMPT, "", b""]


@contextmanager
def rank_process(endpoint: str, backend: dict[str, Any], **spec: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Rank 0 of 1 of a reference ``backend`` (config fields), bound at ``endpoint``, as a remote host starts it."""
    options = ReferenceBackendConfig.model_validate({"name": "peer", **backend}).model_dump(mode="json")
    worker = WorkerSpec(0, 1, endpoint, FACTORY, options, parent_pid=os.getpid(), **spec)
    process = subprocess.Popen([sys.executable, "-m", "backends.workers.worker", worker.to_json()])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


class RankPeer:
    """One dispatcher connection to a rank: send the protocol's messages, read what the rank sends back."""

    def __init__(self, context: zmq.Context, endpoint: str, name: bytes, *, curve: dict[int, bytes] | None = None):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.ROUTING_ID, name)
        self.socket.setsockopt(zmq.LINGER, 0)
        for option, value in (curve or {}).items():
            self.socket.setsockopt(option, value)
        m.bound_queues(self.socket)
        self.socket.connect(endpoint)
        self.stats: m.RankStats | None = None  # the rank's own counters, as last reported

    def send(self, *message: Any) -> None:
        self.socket.send(m.pack(list(message)))

    def hello(self) -> tuple[Any, ...]:
        """Says hello and waits for ``READY`` (a rank still building its engine answers ``STARTING`` first)."""
        self.send(m.RESET)
        while (ready := self.receive())[0] == m.STARTING:
            pass
        assert ready[0] == m.READY, ready
        return ready

    def batch(self, adds: Sequence[list[Any]] = (), aborts: Sequence[str] = (), taken: int = 0) -> None:
        self.send(m.BATCH, list(adds), list(aborts), taken)

    def receive(self, timeout_ms: int = WAIT_MS) -> tuple[Any, ...]:
        assert self.socket.poll(timeout_ms), "the rank sent nothing"
        message = m.unpack_event(self.socket.recv())
        if message[0] == m.STEP:
            self.stats = m.RankStats(*message[4])
        elif message[0] == m.HEARTBEAT:
            self.stats = m.RankStats(*message[1])
        return message  # type: ignore[no-any-return]

    def steps_until_heartbeat(self) -> list[tuple[Any, ...]]:
        """The ``STEP`` messages with outputs the rank sends before its next heartbeat, which it sends only once it
        has sent nothing to this dispatcher for a second: stepping for no one, waiting for a credit, or idle."""
        steps = []
        while (message := self.receive())[0] != m.HEARTBEAT:
            if message[0] == m.STEP and (message[2] or message[3]):
                steps.append(message)
        return steps

    def close(self) -> None:
        self.socket.close(linger=0)


def tokens(steps: Sequence[tuple[Any, ...]]) -> int:
    return sum(len(step[2]) for step in steps)

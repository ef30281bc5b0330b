"""What a rank says before it serves: while it waits out its restart backoff and builds its engine (minutes, for
DeepInfer), a thread answers every dispatcher with ``STARTING`` (its launch number, why the previous incarnation
ended, how long until it builds), and a build that fails is reported to every dispatcher that said hello
(``FAILED``) and to the process that launched it (a pipe), so the reason reaches ``/ready`` of every front end, not
only the rank's log.

The socket belongs to this thread only while the main thread builds the engine; ``finish`` joins the thread, after
which the main thread owns the socket again (ZeroMQ sockets may change threads across such a barrier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import zmq

from backends.workers import messages as m

logger = logging.getLogger(__name__)

POLL_MS = 50
"""How often the thread looks whether the build has finished, between messages."""


class LaunchStatus(NamedTuple):
    """A rank incarnation's place in its restarts, as its launcher (the gateway, the front-end supervisor) tells
    it; ``launch`` counts from 1, ``after`` is why the previous incarnation ended ('' for the first)."""

    launch: int
    after: str
    delay: float  # seconds the worker waits before it builds (its restart backoff)


class StartupResponder:
    """Answers dispatchers while the engine is being built; see the module docstring."""

    def __init__(self, socket: zmq.Socket, status: LaunchStatus) -> None:
        self.socket = socket
        self.status = status
        self.greeted: list[bytes] = []  # dispatchers that said hello (RESET), in order
        self.heard: set[bytes] = set()
        self.stop_requested = False
        self._builds_at = time.monotonic() + status.delay
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-startup", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_delay(self) -> None:
        """The restart backoff, waited on the main thread while dispatchers hear why."""
        remaining = self._builds_at - time.monotonic()
        if remaining > 0:
            self._done.wait(remaining)

    def message(self) -> list[Any]:
        left = max(0.0, self._builds_at - time.monotonic())
        return [m.STARTING, os.getpid(), [self.status.launch, self.status.after, left]]

    def _run(self) -> None:
        socket = self.socket
        while not self._done.is_set():
            if not socket.poll(POLL_MS):
                continue
            try:
                identity, data = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            kind = m.unpack_command(data)[0]
            self.heard.add(identity)
            if kind == m.RESET and identity not in self.greeted:
                self.greeted.append(identity)
            elif kind == m.STOP:
                self.stop_requested = True
            with contextlib.suppress(zmq.ZMQError):  # a full queue or a peer gone: it hears the next one
                socket.send_multipart([identity, m.pack(self.message())], zmq.NOBLOCK)

    def finish(self) -> None:
        """The build is over (either way): the socket is the main thread's again."""
        self._done.set()
        self._thread.join()

    def report_failure(self, reason: str, failure_fd: int | None) -> None:
        """The engine could not be built: every dispatcher heard from, and the launcher, learn why."""
        for identity in self.heard:
            with contextlib.suppress(zmq.ZMQError):
                self.socket.send_multipart([identity, m.pack([m.FAILED, reason])], zmq.NOBLOCK)
        if failure_fd is not None:
            with contextlib.suppress(OSError):
                os.write(failure_fd, reason.encode()[:4096])


def read_failure(fd: int) -> str:
    """What a worker wrote on its failure pipe before it exited ('' if nothing); closes the pipe."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 8192).decode(errors="replace")
    except (BlockingIOError, OSError):
        return ""
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)

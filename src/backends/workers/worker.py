"""One data-parallel rank: a process that owns one engine and drives it (``rank_loop.py``), fed over ZeroMQ by one
or more dispatchers (gateway front-end processes, ``dispatchers.py``).

Run as ``python -m backends.workers.worker SPEC_JSON`` (``spec.py``; the gateway, or the front-end supervisor, does
this for local ranks; a remote host's supervisor does it for remote ones). The main thread binds one ROUTER socket
(any number of dispatchers connect to it), answers them while it constructs the engine (``startup.py``), then runs
the rank's loop until the engine stops or fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys

import zmq

from backends.errors import RankKeysError
from backends.workers import messages as m
from backends.workers.dispatchers import route_to_dispatchers
from backends.workers.keys import keys_for
from backends.workers.rank_loop import Worker
from backends.workers.spec import RankContext, WorkerSpec, load_factory
from backends.workers.startup import LaunchStatus, StartupResponder

logger = logging.getLogger(__name__)


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
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.ROUTER)  # several dispatchers (front-end processes) may connect
    m.bound_queues(socket)
    route_to_dispatchers(socket)
    socket.setsockopt(zmq.LINGER, 2000)
    try:
        keys = keys_for(spec.endpoint, spec.keys)
        authenticator = keys.serve(socket, context) if keys is not None else None
    except RankKeysError as exc:  # before the bind: nobody may reach a rank that cannot check who it is
        logger.error("data-parallel rank %d refuses to start: %s", spec.rank, exc)
        if spec.failure_fd is not None:
            with contextlib.suppress(OSError):
                os.write(spec.failure_fd, str(exc).encode()[:4096])
        return 2
    try:
        return _serve(spec, socket)
    finally:
        if authenticator is not None:
            authenticator.stop()


def _serve(spec: WorkerSpec, socket: zmq.Socket) -> int:
    """Binds the rank's socket, builds its engine and runs it until it stops (0) or fails (1)."""
    socket.bind(spec.endpoint)
    context_for_factory = RankContext(spec.rank, spec.size, spec.lockstep, spec.collective_endpoint, spec.options)
    startup = StartupResponder(socket, LaunchStatus(spec.launch, spec.after, spec.start_delay))
    startup.start()
    try:
        if spec.start_delay:
            logger.info("data-parallel rank %d starts in %.1f s (after: %s)", spec.rank, spec.start_delay, spec.after)
        startup.wait_delay()
        rank_engine = load_factory(spec.factory)(context_for_factory)
    except BaseException as exc:
        logger.exception("data-parallel rank %d failed to build its engine", spec.rank)
        startup.finish()
        startup.report_failure(repr(exc), spec.failure_fd)
        socket.close(linger=1000)
        return 1
    startup.finish()
    worker: Worker | None = None
    try:
        worker = Worker(spec, socket, rank_engine)
        for identity in startup.greeted:  # they said hello while the engine was being built
            worker.hello(identity)
        if startup.stop_requested:
            worker.stop()
        worker.run()
    except BaseException as exc:
        logger.exception("data-parallel rank %d failed", spec.rank)
        if worker is not None:
            with contextlib.suppress(zmq.ZMQError):
                worker.broadcast([m.FAILED, repr(exc)])
        if spec.failure_fd is not None:
            with contextlib.suppress(OSError):
                os.write(spec.failure_fd, repr(exc).encode()[:4096])
        socket.close(linger=1000)
        return 1
    socket.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs the app under uvicorn with the settings and shutdown behaviour a serving gateway needs: one process,
or ``server.runtime.workers`` front-end processes sharing one listening socket under a small supervisor, which also
hosts the data-parallel rank workers once for all of them (``backends/workers/host.py``)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import multiprocess
from uvicorn.server import ServerState

from backends.config import BackendConfig
from backends.interface import RankHosting
from backends.registry import prepare_serving_process, rank_host
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.connections import (
    PROBE_LISTENER,
    PROBE_MAX_CONNECTIONS,
    PROBE_PATHS,
    Clock,
    ConnectionGuard,
    ConnectionLimits,
    ConnectionMetrics,
)
from gateway.logs import configure_logging
from gateway.metrics import MULTIPROCESS_DIR_ENV

logger = logging.getLogger(__name__)
_spawn = multiprocessing.get_context("spawn")
RESTART_PAUSE_SECONDS = 1.0
PARENT_CHECK_SECONDS = 1.0
multiprocessing.allow_connection_pickling()  # the listening socket goes to each worker process


@dataclass(frozen=True)
class ProbeListener:
    """The second listening socket (``server.http.probe_port``) and the guard of its connections."""

    socket: socket.socket
    guard: ConnectionGuard


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, first marks the gateway as draining (``/ready`` 503, new requests refused), then lets
    uvicorn stop accepting and wait for in-flight requests up to ``server.runtime.drain_seconds`` before cancelling them
    (a cancelled stream aborts its engine request).

    With a ``probe`` listener, probes have connections of their own, which uvicorn's drain neither closes nor
    waits for: it keeps answering (``/ready``: draining) until the API listener has drained and the app stopped."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_exit: Callable[[], None],
        *,
        guard: ConnectionGuard,
        probe: ProbeListener | None = None,
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self.guard = guard
        self.probe = probe
        self._probe_state = ServerState()
        self._probe_server: asyncio.Server | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.probe is None or not self.started:
            return
        config, protocol = self.config, self.probe.guard.protocol()

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return protocol(  # type: ignore[call-arg]
                config=config, server_state=self._probe_state, app_state=self.lifespan.state, _loop=_loop
            )

        loop = asyncio.get_running_loop()
        self._probe_server = await loop.create_server(create_protocol, sock=self.probe.socket, backlog=config.backlog)
        logger.info(
            "probe listener (%s) on %s:%s", ", ".join(sorted(PROBE_PATHS)), *self.probe.socket.getsockname()[:2]
        )

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        self._probe_state.default_headers = self.server_state.default_headers  # the Date header, as uvicorn's own
        return should_exit

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if self._probe_server is not None:
                self._probe_server.close()
                for connection in list(self._probe_state.connections):
                    connection.shutdown()


def _serve(
    settings: GatewayConfig,
    sockets: list[socket.socket] | None = None,
    probe_socket: socket.socket | None = None,
    supervisor: int | None = None,
) -> None:
    configure_logging(settings.server.runtime.log_level)
    if supervisor is not None:
        _exit_with(supervisor)
    # The engine thread and the event loop share the GIL. With the default 5 ms switch interval, every numpy or
    # C++ call that releases the GIL on the engine thread can wait up to 5 ms to get it back from a busy loop.
    sys.setswitchinterval(settings.server.runtime.gil_switch_interval)
    prepare_serving_process()  # multi-MiB bodies and prompts go back to the OS when freed (backends/heap.py)
    server = settings.server
    if probe_socket is None and server.http.probe_port is not None:
        probe_socket = bind(server.http.host, server.http.probe_port)
    app = create_app(settings, serve_once_started=server.runtime.workers > 1)
    gateway_server(settings, app, probe_socket=probe_socket).run(sockets=sockets)


def _exit_with(supervisor: int) -> None:
    """A front-end process drains and exits once its supervisor is gone: killed with SIGKILL, the supervisor
    cannot pass SIGTERM on, and an orphan would keep serving the port with nobody to restart or stop it."""

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(PARENT_CHECK_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket's address, bound (``listen`` comes with the server), inheritable by front ends."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def gateway_server(
    settings: GatewayConfig,
    app: FastAPI,
    *,
    probe_socket: socket.socket | None = None,
    clock: Clock | None = None,
) -> DrainingServer:
    """The server as ``serve`` runs it: the API listener under the connection limits of ``settings``, and the
    probe listener on ``probe_socket`` (same limits, its own cap, probe paths only), counted in the app's
    metrics. ``clock``: the connection timers' (None: the event loop)."""
    server = settings.server
    limits = ConnectionLimits(
        server.http.header_timeout, server.http.body_timeout, server.http.max_header_bytes, server.http.max_connections
    )
    metrics = ConnectionMetrics(app.state.gateway.metrics.registry)
    guard = ConnectionGuard(limits, metrics, clock=clock)
    probe = None
    if probe_socket is not None:
        probe_limits = replace(limits, max_connections=PROBE_MAX_CONNECTIONS)
        probe_guard = ConnectionGuard(probe_limits, metrics, listener=PROBE_LISTENER, paths=PROBE_PATHS, clock=clock)
        probe = ProbeListener(probe_socket, probe_guard)
    config = uvicorn_config(settings, app, guard)
    return DrainingServer(config, on_exit=app.state.gateway.begin_drain, guard=guard, probe=probe)


def uvicorn_config(settings: GatewayConfig, app: FastAPI, guard: ConnectionGuard) -> uvicorn.Config:
    """uvicorn as the gateway runs it: uvloop, httptools behind the connection limits of ``guard``."""
    return uvicorn.Config(
        app,
        host=settings.server.http.host,
        port=settings.server.http.port,
        loop="uvloop",
        http=guard.protocol(),
        log_config=None,
        access_log=False,
        # uvicorn annotates these int but uses them as seconds for call_later / wait_for, so fractions work;
        # int() would cut a configured 0.5 s to 0.
        timeout_keep_alive=settings.server.http.keep_alive_timeout,  # type: ignore[arg-type]
        timeout_graceful_shutdown=settings.server.runtime.drain_seconds,  # type: ignore[arg-type]
    )


def run_server(settings: GatewayConfig) -> None:
    if settings.server.runtime.workers == 1:
        _serve(settings)
    else:
        FrontEndSupervisor(settings).run()


class FrontEndSupervisor:
    """Binds the port once and keeps ``server.runtime.workers`` gateway processes serving it: a worker that dies is
    started again; SIGTERM/SIGINT is passed on to every worker, which drains as a single process would.

    Backends with engines in rank workers get their ranks started here, once: every front end connects to them as
    one more dispatcher (``worker_endpoints``), so killing or restarting a front end leaves the ranks serving the
    others. The ranks are stopped after the last front end has drained."""

    def __init__(self, settings: GatewayConfig) -> None:
        self.settings = settings
        self.stopping = False
        self.workers: list[multiprocessing.process.BaseProcess | None] = []
        """One slot per front-end process; None once a process has ended for good (while stopping)."""
        self.hosts: list[RankHosting] = []

    def _host_ranks(self, run_dir: str) -> GatewayConfig:
        """Starts the ranks of every backend that has them; returns the settings the front ends run with (those
        backends' ranks as ``worker_endpoints``)."""
        backends: list[BackendConfig] = []
        for backend in self.settings.backends:
            host = rank_host(backend, run_dir)
            if host is not None:
                host.start()
                self.hosts.append(host)
                backend = backend.model_copy(update={"worker_endpoints": host.endpoints})
            backends.append(backend)
        return self.settings.model_copy(update={"backends": backends})

    def _start(self, sock: socket.socket, probe: socket.socket | None) -> multiprocessing.process.BaseProcess:
        worker = _spawn.Process(target=_serve, args=(self.front_end_settings, [sock], probe, os.getpid()), daemon=False)
        worker.start()
        logger.info("front-end process %s started", worker.pid)
        return worker

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True
        for worker in self.workers:
            if worker is not None and worker.pid is not None and worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)

    def run(self) -> None:
        configure_logging(self.settings.server.runtime.log_level)
        # Request metrics of every process go to files here, so a scrape answered by any process sums them all.
        metrics_dir = tempfile.mkdtemp(prefix="deepinfer-gateway-metrics-")
        os.environ[MULTIPROCESS_DIR_ENV] = metrics_dir
        run_dir = tempfile.mkdtemp(prefix="deepinfer-gateway-ranks-")
        try:
            self.front_end_settings = self._host_ranks(run_dir)
            self._supervise()
        finally:
            for host in self.hosts:
                host.stop()
            shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _supervise(self) -> None:
        server = self.settings.server
        sock = bind(server.http.host, server.http.port)
        probe = bind(server.http.host, server.http.probe_port) if server.http.probe_port is not None else None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        self.workers = [self._start(sock, probe) for _ in range(server.runtime.workers)]
        logger.info("serving on %s:%s with %d front-end processes", *sock.getsockname()[:2], len(self.workers))
        while running := [w for w in self.workers if w is not None]:
            waits = [host.timeout(time.monotonic()) for host in self.hosts]
            due = [t for t in waits if t is not None]
            descriptors: list[int] = [w.sentinel for w in running]
            for host in self.hosts:
                descriptors += host.descriptors()
            ended = multiprocessing.connection.wait(descriptors, timeout=min(due) if due else None)
            now = time.monotonic()
            for host in self.hosts:
                host.on_exited(ended, now)
                host.relaunch_due(now)
            for position, worker in enumerate(self.workers):
                if worker is None or worker.sentinel not in ended:
                    continue
                worker.join()  # its sentinel fired, so it has exited or is about to: reap it
                multiprocess.mark_process_dead(worker.pid)  # its in-flight gauge no longer counts; counters stay
                if self.stopping:
                    self.workers[position] = None
                    continue
                logger.warning("front-end process %s exited with %s; starting another", worker.pid, worker.exitcode)
                time.sleep(RESTART_PAUSE_SECONDS)  # a process that cannot start must not spin the host
                self.workers[position] = None if self.stopping else self._start(sock, probe)
        sock.close()
        if probe is not None:
            probe.close()

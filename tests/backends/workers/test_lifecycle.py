"""Starting and stopping worker processes: clean shutdown with work in flight, no orphans, remote ranks over TCP."""

from __future__ import annotations

import asyncio
import os
import signal
import socket as socketlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from backends.config import ReferenceBackendConfig
from backends.errors import BackendError
from backends.interface import GenerateRequest, SamplingOptions
from backends.reference.backend import build_reference_backend, load_tokenizer
from backends.workers.backend import DataParallelBackend
from backends.workers.driver import DataParallelDriver
from backends.workers.launch import WorkerPlan, free_port
from backends.workers.spec import WorkerSpec

from ...conftest import wait_until
from ...waiting import until
from .conftest import clock_of, driver_of, start_data_parallel_gateway, stop_gateway, worker_pids


async def first_event_then_rest(backend: DataParallelBackend, request_id: str, started: asyncio.Event) -> object:
    """Runs a long request; returns how it ended (an exception, or None if it finished)."""
    request = GenerateRequest(
        request_id=request_id,
        model="m",
        prompt="Tell me about files.",
        sampling=SamplingOptions(max_tokens=3000, ignore_eos=True),
    )
    try:
        async for _ in backend.generate(request):
            started.set()
    except BackendError as exc:
        return exc
    return None


@pytest.mark.parametrize(
    "options",
    [
        {"data_parallel_size": 2, "lockstep": True},
        {"data_parallel_size": 2, "worker_transport": "tcp"},
    ],
    ids=["lockstep-ipc", "independent-tcp"],
)
async def test_stop_with_work_in_flight_closes_every_rank_and_leaves_no_process(options: dict[str, object]) -> None:
    config = ReferenceBackendConfig(name="dp", timing={"decode_seconds_per_step": 0.01}, **options)  # type: ignore[arg-type]
    backend = build_reference_backend(config)
    assert isinstance(backend, DataParallelBackend)
    await backend.start()
    processes = [rank.process for rank in backend.driver.ranks]
    assert all(p is not None for p in processes)
    assert worker_pids(os.getpid()) == {p.pid for p in processes if p is not None}

    started = [asyncio.Event() for _ in range(3)]
    requests = [asyncio.create_task(first_event_then_rest(backend, f"r{i}", started[i])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
    assert backend.driver.in_flight == 3

    await backend.stop()
    endings = await asyncio.gather(*requests)
    assert all(isinstance(e, BackendError) and "shutting down" in str(e) for e in endings)
    # Exit code 0: each worker closed its engine and left on its own (in lockstep, in the same collective).
    assert [p.returncode for p in processes if p is not None] == [0, 0]
    assert worker_pids(os.getpid()) == set()


# ---- remote ranks: started elsewhere, reached over TCP -----------------------------------------------------------


def start_remote_worker(rank: int, endpoint: str, options: dict[str, object]) -> subprocess.Popen[bytes]:
    spec = WorkerSpec(rank, 2, endpoint, "backends.reference.backend:build_rank_engine", options)
    return subprocess.Popen([sys.executable, "-m", "backends.workers.worker", spec.to_json()])


@pytest.fixture(scope="module")
def remote_workers() -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]], dict[str, object]]]:
    endpoints = [f"tcp://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    options = ReferenceBackendConfig(name="remote", data_parallel_size=2, worker_endpoints=endpoints).model_dump(
        mode="json"
    )
    workers = [start_remote_worker(rank, endpoint, options) for rank, endpoint in enumerate(endpoints)]
    yield endpoints, workers, options
    for worker in workers:
        worker.kill()
        worker.wait()


def test_remote_ranks_serve_survive_a_restart_and_outlive_the_gateway(
    remote_workers: tuple[list[str], list[subprocess.Popen[bytes]], dict[str, object]],
) -> None:
    endpoints, workers, options = remote_workers
    gateway = start_data_parallel_gateway(
        [{"name": "remote", "kind": "reference", "data_parallel_size": 2, "worker_endpoints": endpoints}]
    )
    try:
        driver = driver_of(gateway, "remote")
        assert [rank.pid for rank in driver.ranks] == [w.pid for w in workers]
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            body = {"model": "remote", "prompt": "Hello", "max_tokens": 4}
            for _ in range(2):
                assert http.post("/v1/completions", json=body).status_code == 200
            assert [rank.dispatched for rank in driver.ranks] == [1, 1]

            # The remote supervisor replaces rank 0 behind the same endpoint: its READY brings the rank back.
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait()
            workers[0] = start_remote_worker(0, endpoints[0], options)
            assert wait_until(lambda: driver.ranks[0].pid == workers[0].pid and driver.ranks[0].state == "up", 30)
            for _ in range(2):
                assert http.post("/v1/completions", json=body).status_code == 200
            assert driver.ranks[0].dispatched >= 2
    finally:
        stop_gateway(gateway)
    # The gateway neither started nor stops remote ranks: they wait for the next dispatcher.
    assert all(w.poll() is None for w in workers)


# ---- local ranks over TCP: a fresh port at each launch ------------------------------------------------------------


def test_a_tcp_rank_whose_old_port_was_taken_comes_back_on_another() -> None:
    gateway = start_data_parallel_gateway(
        [{"name": "tcp", "kind": "reference", "data_parallel_size": 2, "worker_transport": "tcp"}]
    )
    try:
        driver = driver_of(gateway, "tcp")
        victim = driver.ranks[1]
        old_endpoint = victim.endpoint
        host, port = old_endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socketlib.socket() as squatter:
            with clock_of(gateway, "tcp").held():
                assert victim.process is not None
                victim.process.kill()
                assert wait_until(lambda: victim.state == "down" and victim.process is None)
                # Another server takes the port while the rank waits to restart (SO_REUSEADDR, as servers do: the
                # killed worker's connections linger in TIME_WAIT).
                squatter.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)
                squatter.bind((host, int(port)))
                squatter.listen()
            assert wait_until(lambda: victim.state == "up", 30)
            assert victim.endpoint != old_endpoint
        assert victim.restarts == 1
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            body = {"model": "tcp", "prompt": "Hello", "max_tokens": 4}
            before = victim.dispatched
            for _ in range(2):  # equal loads alternate ranks: one goes to the restarted rank
                assert http.post("/v1/completions", json=body).status_code == 200
            assert victim.dispatched == before + 1
    finally:
        stop_gateway(gateway)


async def test_a_rank_whose_worker_cannot_be_spawned_is_retried_until_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    options = ReferenceBackendConfig(name="dp", data_parallel_size=2).model_dump(mode="json")
    plan = WorkerPlan(2, "backends.reference.backend:build_rank_engine", options, restart_backoff=0.05, max_backoff=0.2)
    driver = DataParallelDriver("dp", plan, load_tokenizer)
    await driver.start()
    try:
        victim = driver.ranks[1]
        assert victim.process is not None
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # e.g. the environment was upgraded away
        victim.process.kill()
        assert await until(lambda: "cannot start its worker process" in victim.reason)
        assert await until(lambda: victim.launches >= 4)  # retried, with backoff
        monkeypatch.undo()
        assert await until(lambda: victim.state == "up")
        assert driver.ranks[0].state == "up" and driver.ranks[0].restarts == 0
        processes = [rank.process for rank in driver.ranks]
    finally:
        await driver.stop()
    assert all(p is not None and p.returncode == 0 for p in processes)

"""Gateways whose reference backends run their engines in data-parallel worker processes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from backends.registry import build_backend
from backends.workers.driver import DataParallelDriver
from gateway.admission import behind_flow_control
from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until

STEP = {"decode_seconds_per_step": 0.01}  # requests last long enough to overlap, and tests stay fast
RESTART_BACKOFF = 1.0
"""Long enough that two ranks killed one after the other fail inside one backoff window."""


class HoldableClock:
    """A test double of the supervisor's ``Clock``: the event loop's own time and timers, except that a timer coming
    due while the clock is held runs only at ``release``. Restarts then happen later than the backoff, never
    earlier, so a test can look at a degraded state without racing the restart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._waiting: list[Callable[[], object]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        self._loop = loop = asyncio.get_running_loop()
        return loop.call_at(when, self._fire, callback)

    def _fire(self, callback: Callable[[], object]) -> None:
        with self._lock:
            if self._held:
                self._waiting.append(callback)
                return
        callback()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._held = True
        try:
            yield
        finally:
            with self._lock:
                self._held = False
                waiting, self._waiting = self._waiting, []
            for callback in waiting:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(callback)


def start_with_ranks(
    config: GatewayConfig, *, ready_timeout: float, holdable_clock: bool = False, wait_for: str = "/ready"
) -> RunningGateway:
    """The gateway of ``config``, whose data-parallel backends are built here so that their supervisors restart a
    failed group after ``RESTART_BACKOFF`` (and keep time with a ``HoldableClock`` when asked); returns once
    ``wait_for`` answers 200."""
    built = {}
    for backend_config in config.backends:
        backend = build_backend(backend_config)
        backend.driver.plan.restart_backoff = RESTART_BACKOFF  # type: ignore[attr-defined]
        if holdable_clock:
            backend.driver.clock = HoldableClock()  # type: ignore[attr-defined]
        built[backend_config.name] = behind_flow_control(backend, backend_config)
    return start_gateway(config, backends=built, ready_timeout=ready_timeout, wait_for=wait_for)


def one_model_per_backend(backends: list[dict[str, object]]) -> GatewayConfig:
    return GatewayConfig(backends=backends, models=[{"name": b["name"], "backends": [b["name"]]} for b in backends])


def start_data_parallel_gateway(backends: list[dict[str, object]]) -> RunningGateway:
    return start_with_ranks(one_model_per_backend(backends), ready_timeout=60, holdable_clock=True)


@pytest.fixture(scope="module")
def dp_gateway() -> Iterator[RunningGateway]:
    """Two independent ranks (``dp``) and a lockstep group of three (``lockstep``), in one gateway."""
    running = start_data_parallel_gateway(
        [
            {"name": "dp", "kind": "reference", "data_parallel_size": 2, "timing": STEP},
            {"name": "lockstep", "kind": "reference", "data_parallel_size": 3, "lockstep": True, "timing": STEP},
        ]
    )
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def http(dp_gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dp_gateway.base_url, timeout=60) as client:
        yield client


def driver_of(gateway: RunningGateway, backend: str) -> DataParallelDriver:
    return unwrapped(gateway.state.backends[backend]).driver  # type: ignore[attr-defined,no-any-return]


def clock_of(gateway: RunningGateway, backend: str) -> HoldableClock:
    clock = driver_of(gateway, backend).clock
    assert isinstance(clock, HoldableClock)
    return clock


def worker_pids(parent: int) -> set[int]:
    """Live worker processes whose parent is ``parent``, read from /proc (no psutil)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == parent and state != "Z" and b"backends.workers.worker" in cmdline:
            pids.add(int(entry.name))
    return pids


# ---- helpers the data-parallel tests share (workers here, the deepinfer kind in tests/backends/deepinfer) ----


def chat(http: httpx.Client, model: str, text: str, max_tokens: int, **extra: object) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@contextmanager
def open_stream(http: httpx.Client, model: str, max_tokens: int) -> Iterator[Iterator[str]]:
    """A streaming chat request that generates ``max_tokens`` tokens; yields its SSE data payloads."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about files."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        yield (line[6:] for line in response.iter_lines() if line.startswith("data: "))


def holding_rank(gateway: RunningGateway, backend: str) -> int:
    """The one rank that holds a request (waits for the dispatcher to have sent it)."""
    driver = driver_of(gateway, backend)
    assert wait_until(lambda: sum(r.outstanding for r in driver.ranks) == 1)
    return next(r.index for r in driver.ranks if r.outstanding == 1)


def steps(gateway: RunningGateway, backend: str) -> list[int]:
    return [rank.totals().steps for rank in driver_of(gateway, backend).ranks]

"""Shared fixtures: real gateways on loopback (uvicorn on a random port), clients, schema validators."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import structlog
import uvicorn
from fastapi import FastAPI
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir
from prometheus_client.parser import text_string_to_metric_families

from backends.interface import Backend
from gateway.app import create_app
from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig
from gateway.gateway_state import GatewayState
from gateway.server import gateway_server
from gateway.server_config import FLAT_KEYS

from .conformance import OpenAISchemas
from .waiting import wait_ready, wait_until

# The property and fuzz tests draw the same examples on every run (derandomized, no example database), so
# `make test` gives the same verdict every time, in any clone: a red run is a reproducible failure, never a
# leftover of an earlier run. `make explore` (HYPOTHESIS_PROFILE=explore) draws fresh random examples instead,
# to look for new failures; pin any it finds as an explicit test.
# Hypothesis's own caches (the literals it collects from the code) go outside the repository, so nothing of a
# run stays in the clone.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"deepinfer-gateway-hypothesis-{os.getuid()}")
# The gateways of a run keep their default SQLite stores (stored responses, batches) in a folder of the run's own,
# inherited by the gateway processes tests start: never a developer's ~/.cache/deepinfer-gateway/*.sqlite3, whose
# batches a test gateway would otherwise pick up and run.
os.environ["DEEPINFER_GATEWAY_STATE"] = tempfile.mkdtemp(prefix="deepinfer-gateway-state-")
atexit.register(shutil.rmtree, os.environ["DEEPINFER_GATEWAY_STATE"], ignore_errors=True)
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, database=None, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

MODEL = "deepinfer-reference"
TINY_MODEL = "tiny-context"
TINY_CONTEXT = 64


@dataclass
class RunningGateway:
    base_url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway

    def engine_unfinished(self, backend: str = "reference") -> int:
        engine = unwrapped(self.state.backends[backend]).driver.engine  # type: ignore[attr-defined]
        return engine.get_num_unfinished_requests()

    def driver_in_flight(self, backend: str = "reference") -> int:
        return unwrapped(self.state.backends[backend]).driver.in_flight  # type: ignore[attr-defined]

    def engine_tokens(self, backend: str = "reference") -> int:
        """Tokens the engine has generated so far (every output its ``step()`` returned)."""
        return unwrapped(self.state.backends[backend]).driver.stats.tokens  # type: ignore[attr-defined]

    def engine_idle(self, backend: str = "reference") -> bool:
        """The engine holds no request and the driver no stream: every request ended or was aborted."""
        return self.engine_unfinished(backend) == 0 and self.driver_in_flight(backend) == 0

    def metric(self, sample: str, **labels: str) -> float:
        """The sum of ``/metrics`` samples named ``sample`` whose labels include ``labels`` (scraped with the admin
        key, when the gateway has one)."""
        admin = self.state.config.server.auth.admin_api_key
        headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        return sum(
            found.value
            for family in text_string_to_metric_families(httpx.get(f"{self.base_url}/metrics", headers=headers).text)
            for found in family.samples
            if found.name == sample and all(found.labels.get(k) == v for k, v in labels.items())
        )


def server_sections(**keys: object) -> dict[str, dict[str, object]]:
    """``server`` settings given by key name (``port=0``), placed in their sections (``{"http": {"port": 0}}``)
    the way a config file writes them, so a test sets a few keys without the deprecated flat spelling."""
    sections: dict[str, dict[str, object]] = {}
    for key, value in keys.items():
        sections.setdefault(FLAT_KEYS[key], {})[key] = value
    return sections


def start_gateway(
    config: GatewayConfig,
    *,
    backends: Mapping[str, Backend] | None = None,
    wait_for: str = "/ready",
    ready_timeout: float = 180.0,
    budget_clock: Callable[[], float] | None = None,
    batch_clock: Callable[[], float] = time.time,
    prepare: Callable[[FastAPI], object] | None = None,
) -> RunningGateway:
    """Runs the gateway's server as ``serve`` does (uvicorn on uvloop behind the connection guard, whose protocol
    also gives streams their direct body writes) in a thread on 127.0.0.1 with a kernel-chosen port, and waits
    until ``wait_for`` is 200. ``prepare`` is called with the app before it serves, as a library user's code would
    (``app.add_middleware``, say)."""
    app = create_app(config, backends, budget_clock=budget_clock, batch_clock=batch_clock)
    if prepare is not None:
        prepare(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = gateway_server(config, app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    if wait_ready(f"{base_url}{wait_for}", timeout=ready_timeout):
        return RunningGateway(base_url, app, server, thread)
    server.should_exit = True
    raise RuntimeError(f"gateway at {base_url} did not become ready in {ready_timeout} s")


def stop_gateway(gateway: RunningGateway) -> None:
    """Stops the gateway and waits until its thread has ended: its drain, then its lifespan's shutdown (the batch
    runner, the backends). A gateway left running would go on logging into later tests, against stores their
    fixtures have removed."""
    gateway.server.should_exit = True
    gateway.thread.join(timeout=gateway.state.config.server.runtime.drain_seconds + 30)
    assert not gateway.thread.is_alive(), "the gateway did not stop within its drain and 30 s more"


def wait_for_requests_done(gateway: RunningGateway) -> None:
    """Waits until the gateway has finished every request it was serving, down to what it does after a response's
    last byte (its access-log line, its server span's end)."""
    assert wait_until(lambda: not gateway.server.server_state.tasks), "a request is still being served"


@contextlib.contextmanager
def captured_logs(gateway: RunningGateway) -> Iterator[list[dict[str, Any]]]:
    """structlog's lines of the requests the block makes: the capture starts once the gateway has finished every
    request it was serving, and ends once it has finished those too. A request's access-log line is written after
    its response's last byte is sent, so a client can have read the whole response (and the block have ended) before
    the line exists, and an earlier request's line can come after the block started."""
    wait_for_requests_done(gateway)
    with structlog.testing.capture_logs() as logs:
        yield logs
        wait_for_requests_done(gateway)


def logged_error_detail(logs: list[dict[str, object]]) -> str:
    """The detail of the one server error in captured access-log lines (clients see only a generic message)."""
    (detail,) = [
        str(line["error_detail"]) for line in logs if line.get("event") == "request" and "error_detail" in line
    ]
    return detail


@pytest.fixture
def collected_garbage() -> Iterator[list[object]]:
    """What the cycle collector finds unreachable while the test runs (kept, not freed), from a clean start."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()


@pytest.fixture(scope="session")
def gateway() -> Iterator[RunningGateway]:
    """The default reference model plus a tiny-context one, in one real server."""
    config = GatewayConfig(
        backends=[
            {"name": "reference", "kind": "reference"},
            {"name": "tiny", "kind": "reference", "max_model_len": TINY_CONTEXT},
        ],
        models=[
            {"name": MODEL, "backends": ["reference"]},
            {"name": TINY_MODEL, "backends": ["tiny"]},
        ],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


TIMED_STEP = 0.002
"""Seconds per decode step of the timed engine: 2,000 tokens take 4 s, so an abort that never reaches the engine
shows in its counters, while the engine still outruns a loop serving 100 streams (which then paces it)."""


@pytest.fixture(scope="session")
def timed_gateway() -> Iterator[RunningGateway]:
    """The reference model on an engine with a timing model, for tests about aborting engine work."""
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": TIMED_STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="session")
def client(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def schemas() -> OpenAISchemas:
    return OpenAISchemas.load()

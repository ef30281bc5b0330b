"""Fixtures: LMDeploy's real api_server (stub engine) in its own cached virtualenv, and gateways in front of it.

The harness virtualenv is built on first use (about a minute here, a few on a slow network) and cached under
``$DEEPINFER_GATEWAY_CACHE``; a node then starts in about 5 s. One node serves most tests for the whole session;
tests that kill or disturb nodes start their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.config import LMDeployBackendConfig
from backends.lmdeploy import LMDeployBackend
from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway
from .harness.server import API_KEY, MODEL_NAME, HarnessNode, make_node, stub_model_dir
from .harness.venv import harness_python

SESSION_LEN = 256
PUBLIC_MODEL = "lm-model"
MAIN_NODE_ARGS = (
    "--model-name",
    MODEL_NAME,
    "--session-len",
    str(SESSION_LEN),
    "--api-keys",
    API_KEY,
    "--tool-call-parser",
    "qwen3",
    "--reasoning-parser",
    "deepseek-v3",
)

HARNESS_BUILD_TIMEOUT = 1800


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The first test that starts a harness node may have to build its virtualenv: give the tests that use the
    harness (here, and the cross-kind routing tests) room until it is cached."""
    if harness_python() is not None:
        return
    here = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        if here in path.parents or "lmdeploy" in path.name:
            item.add_marker(pytest.mark.timeout(HARNESS_BUILD_TIMEOUT))


@pytest.fixture(scope="session")
def harness_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lmdeploy")


@pytest.fixture(scope="session")
def model_dir(harness_dir: Path) -> Path:
    return stub_model_dir(harness_dir)


@pytest.fixture(scope="session")
def node(harness_dir: Path, model_dir: Path) -> Iterator[HarnessNode]:
    """The shared node: api keys, session length 256, qwen3 tool parser, deepseek-v3 reasoning parser."""
    started = make_node(harness_dir, "main", *MAIN_NODE_ARGS, model_dir=model_dir).start()
    yield started
    started.stop()


def backend_config(urls: list[str], **overrides: Any) -> dict[str, Any]:
    return {
        "name": "lm",
        "kind": "lmdeploy",
        "urls": urls,
        "api_key": API_KEY,
        "max_model_len": SESSION_LEN,
        "health_interval": 0.3,
        "health_timeout": 2.0,
        **overrides,
    }


@contextlib.asynccontextmanager
async def running_backend(urls: list[str], **overrides: Any) -> AsyncIterator[LMDeployBackend]:
    """An LMDeployBackend started in the test's own event loop."""
    backend = LMDeployBackend(LMDeployBackendConfig(**backend_config(urls, **overrides)))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


def gateway_config(urls: list[str], **overrides: Any) -> GatewayConfig:
    # The gateway's own circuit breaker would stop routing to the backend after the injected engine failures;
    # these tests are about the backend's own node health.
    breaker = {"failure_threshold": 1000}
    return GatewayConfig(
        backends=[backend_config(urls, **overrides)],
        models=[{"name": PUBLIC_MODEL, "backends": ["lm"], "circuit_breaker": breaker}],
    )


@pytest.fixture(scope="session")
def lm_gateway(node: HarnessNode) -> Iterator[RunningGateway]:
    """The gateway in front of the shared node; injected engine failures must not take its only node out."""
    running = start_gateway(gateway_config([node.url], failure_threshold=1000))
    yield running
    stop_gateway(running)

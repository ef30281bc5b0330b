"""Fixtures of the gateway tests that need a configuration of their own."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway
from ..responses_conformance import ConformingTransport


@pytest.fixture(scope="session")
def responses_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """The reference model, storing responses in an SQLite file of its own."""
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    config = GatewayConfig(
        server={"stores": {"responses_store": f"sqlite://{path}"}},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="session")
def conforming_transport() -> ConformingTransport:
    return ConformingTransport()


@pytest.fixture(scope="session")
def responses_client(responses_gateway: RunningGateway, conforming_transport: ConformingTransport) -> openai.OpenAI:
    """The openai SDK, over a transport that checks every Responses body and event against the SDK's types."""
    return openai.OpenAI(
        base_url=f"{responses_gateway.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(transport=conforming_transport),
    )

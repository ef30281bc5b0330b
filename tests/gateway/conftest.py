"""Fixtures of the gateway tests that need a configuration of their own."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway


@pytest.fixture(scope="session")
def responses_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """The reference model, storing responses in an SQLite file of its own."""
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    config = GatewayConfig(
        server={"responses_store": f"sqlite://{path}"},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="session")
def responses_client(responses_gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{responses_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

"""A gateway for the Messages API tests: the reference model under the names Claude Code and SDK users send, two
models with small contexts, and client keys (one of them with a small request budget)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import httpx2
import pytest

from gateway.config import GatewayConfig

from ...anthropic_conformance import ConformingTransport
from ...conftest import MODEL, TINY_CONTEXT, TINY_MODEL, RunningGateway, start_gateway, stop_gateway

KEY = "sk-messages-0001"
LIMITED_KEY = "sk-messages-limited"
LIMITED_REQUESTS = 3
ALIASES = ("claude-sonnet-4-6", "claude-haiku-4-5")
SIGNATURE_SECRET = "messages-tests-signature-secret"
SMALL_MODEL = "small-context"
SMALL_CONTEXT = 512


@pytest.fixture(scope="session")
def messages_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [KEY, {"key": LIMITED_KEY, "name": "limited", "requests_per_minute": LIMITED_REQUESTS}],
                "thinking_signature_key": SIGNATURE_SECRET,
                "admin_api_key": "sk-messages-admin",
            }
        },
        backends=[
            {"name": "reference", "kind": "reference"},
            {"name": "tiny", "kind": "reference", "max_model_len": TINY_CONTEXT},
            {"name": "small", "kind": "reference", "max_model_len": SMALL_CONTEXT},
        ],
        models=[
            {"name": MODEL, "aliases": list(ALIASES), "backends": ["reference"]},
            {"name": TINY_MODEL, "backends": ["tiny"]},
            {"name": SMALL_MODEL, "backends": ["small"]},
        ],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="session")
def conforming() -> ConformingTransport:
    return ConformingTransport()


@pytest.fixture(scope="session")
def claude(messages_gateway: RunningGateway, conforming: ConformingTransport) -> anthropic.Anthropic:
    """The anthropic SDK, over a transport that checks every body and event against the SDK's own types."""
    return anthropic.Anthropic(
        base_url=messages_gateway.base_url,
        api_key=KEY,
        max_retries=0,
        timeout=60,
        http_client=httpx2.Client(transport=conforming),
    )


@pytest.fixture(scope="session")
def raw(messages_gateway: RunningGateway) -> Iterator[httpx.Client]:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=messages_gateway.base_url, headers=headers, timeout=60) as c:
        yield c

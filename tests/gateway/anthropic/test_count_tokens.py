"""``/v1/messages/count_tokens`` is a request like any other: the model's routing chooses the target that counts
(pinning included), and the key's request budget admits it. The count itself is checked against ``/v1/messages``'
``input_tokens`` in test_messages.py (reference engine) and tests/backends/lmdeploy/test_messages.py (LMDeploy)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from gateway.config import GatewayConfig

from ...budget_client import charged
from ...conftest import RunningGateway, start_gateway, stop_gateway

KEY = "sk-count-0001"
ONE_REQUEST_KEY = "sk-count-once"
TOKENS_KEY = "sk-count-tokens"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def counting_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [
                    KEY,
                    {"key": ONE_REQUEST_KEY, "name": "once", "requests_per_minute": 1},
                    {"key": TOKENS_KEY, "name": "tokens", "tokens_per_minute": 100_000},
                ],
                "public_metrics": True,  # the test reads what keys were charged
            }
        },
        backends=[{"name": "left", "kind": "reference"}, {"name": "right", "kind": "reference"}],
        models=[{"name": "pair", "backends": ["left", "right"], "allow_pin_header": True}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def _client(gateway: RunningGateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0)


def test_the_pin_header_chooses_the_target_that_counts(counting_gateway: RunningGateway) -> None:
    client = _client(counting_gateway, KEY)
    for backend in ("left", "right"):
        counted = client.messages.with_raw_response.count_tokens(
            model="pair", messages=HI, extra_headers={"X-Backend": backend}
        )
        assert counted.headers["x-backend"] == backend
        assert counted.parse().input_tokens > 0


def test_a_pin_to_a_backend_outside_the_model_is_refused_naming_the_header(counting_gateway: RunningGateway) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        _client(counting_gateway, KEY).messages.count_tokens(
            model="pair", messages=HI, extra_headers={"X-Backend": "elsewhere"}
        )
    assert "X-Backend" in refused.value.message


def test_a_count_takes_a_request_from_the_keys_budget(counting_gateway: RunningGateway) -> None:
    client = _client(counting_gateway, ONE_REQUEST_KEY)
    assert client.messages.count_tokens(model="pair", messages=HI).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError):
        client.messages.count_tokens(model="pair", messages=HI)


def test_a_count_the_engine_answers_from_its_tokenizer_is_charged_no_tokens(counting_gateway: RunningGateway) -> None:
    client = _client(counting_gateway, TOKENS_KEY)
    assert client.messages.count_tokens(model="pair", messages=HI).input_tokens > 0
    assert charged(counting_gateway, "tokens") == 0
    assert client.messages.create(model="pair", max_tokens=2, messages=HI).usage.output_tokens > 0
    assert charged(counting_gateway, "tokens") > 0, "the same key's generation is charged (the metric counts)"

"""API keys, admin key and per-key limits, as a client and an operator meet them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway

CLIENT_KEY = "sk-client-0123456789"
LIMITED_KEY = "sk-limited-0123456789"
TOKEN_KEY = "sk-tokens-0123456789"
ADMIN_KEY = "sk-admin-0123456789"


@pytest.fixture(scope="module")
def secured() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [
                    CLIENT_KEY,
                    {"key": LIMITED_KEY, "name": "team-b", "requests_per_minute": 2},
                    {"key": TOKEN_KEY, "name": "team-t", "tokens_per_minute": 30},
                ],
                "admin_api_key": ADMIN_KEY,
            }
        },
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_requests_without_a_key_or_with_a_wrong_one_get_401(secured: RunningGateway) -> None:
    missing = httpx.get(f"{secured.base_url}/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(f"{secured.base_url}/v1/models", headers={"Authorization": "Bearer sk-wrong-000000"})
    assert wrong.status_code == 401
    assert "sk-wrong" not in wrong.text, "keys are never echoed"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="sk-nope-00000000", max_retries=0).models.list()


def test_bearer_and_x_api_key_are_both_accepted(secured: RunningGateway) -> None:
    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=CLIENT_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{secured.base_url}/v1/models", headers={"x-api-key": CLIENT_KEY}).status_code == 200


def test_health_and_ready_need_no_key(secured: RunningGateway) -> None:
    assert httpx.get(f"{secured.base_url}/health").status_code == 200
    assert httpx.get(f"{secured.base_url}/ready").status_code == 200


def test_metrics_need_the_admin_key_not_a_client_key(secured: RunningGateway) -> None:
    assert httpx.get(f"{secured.base_url}/metrics").status_code == 401
    client_key = httpx.get(f"{secured.base_url}/metrics", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert client_key.status_code == 401
    admin = httpx.get(f"{secured.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200 and "gateway_requests_total" in admin.text


def test_open_paths_are_matched_exactly_not_by_prefix(secured: RunningGateway) -> None:
    for path in ("/healthz", "/health/", "/ready/x", "/readyz"):
        assert httpx.get(f"{secured.base_url}{path}").status_code == 401, f"{path} is not an open path"
    for path in ("/metricsx", "/administrator"):  # not operator endpoints either: they need a client key
        assert httpx.get(f"{secured.base_url}{path}").status_code == 401
        client = httpx.get(f"{secured.base_url}{path}", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert client.status_code == 404


def test_admin_endpoints_need_the_admin_key(secured: RunningGateway) -> None:
    for path in ("/admin/targets", "/admin"):
        assert httpx.get(f"{secured.base_url}{path}").status_code == 401
        as_client = httpx.get(f"{secured.base_url}{path}", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert as_client.status_code == 401
    admin = httpx.get(f"{secured.base_url}/admin/targets", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200 and MODEL in admin.json()["models"]


@pytest.fixture(scope="module")
def no_admin_key() -> Iterator[RunningGateway]:
    """Client keys and no admin key: the operator endpoints must stay closed (fail closed)."""
    config = GatewayConfig(
        server={"auth": {"api_keys": [CLIENT_KEY]}},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.mark.parametrize("path", ["/admin/targets", "/admin", "/metrics"])
def test_operator_endpoints_refuse_everyone_when_client_keys_exist_but_no_admin_key(
    no_admin_key: RunningGateway, path: str
) -> None:
    for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}, {"Authorization": "Bearer sk-guess-00000000"}):
        refused = httpx.get(f"{no_admin_key.base_url}{path}", headers=headers)
        assert refused.status_code == 403, (path, headers)
        error = refused.json()["error"]
        assert error["code"] == "admin_key_not_configured"
        assert "server.auth.admin_api_key" in error["message"], "the message names the setting to fix"
    chat = httpx.post(
        f"{no_admin_key.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
    )
    assert chat.status_code == 200, "client traffic is not affected"


def test_public_metrics_opens_metrics_only() -> None:
    config = GatewayConfig(
        server={"auth": {"api_keys": [CLIENT_KEY], "admin_api_key": ADMIN_KEY, "public_metrics": True}},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    try:
        scraped = httpx.get(f"{running.base_url}/metrics")
        assert scraped.status_code == 200 and "gateway_requests_total" in scraped.text
        assert httpx.get(f"{running.base_url}/admin/targets").status_code == 401
        assert httpx.get(f"{running.base_url}/v1/models").status_code == 401
    finally:
        stop_gateway(running)


def test_requests_per_minute_limit_gives_429_with_retry_after_and_ratelimit_headers(secured: RunningGateway) -> None:
    headers = {"Authorization": f"Bearer {LIMITED_KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{secured.base_url}/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert httpx.post(url, json=body, headers=headers).status_code == 200
    limited = httpx.post(url, json=body, headers=headers)
    assert limited.status_code == 429
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    other = httpx.post(url, json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert other.status_code == 200, "one key's limit does not touch another key"


def test_tokens_per_minute_limit_blocks_after_the_budget_is_spent(secured: RunningGateway) -> None:
    headers = {"Authorization": f"Bearer {TOKEN_KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True}
    url = f"{secured.base_url}/v1/chat/completions"
    assert httpx.post(url, json=body, headers=headers).status_code == 200
    limited = httpx.post(url, json=body, headers=headers)
    assert limited.status_code == 429
    assert limited.headers["x-ratelimit-limit-tokens"] == "30"
    assert int(limited.headers["retry-after"]) >= 1


def test_access_log_names_the_key_and_covers_rejected_requests(secured: RunningGateway) -> None:
    headers = {"Authorization": f"Bearer {LIMITED_KEY}"}
    with captured_logs(secured) as logs:
        httpx.post(f"{secured.base_url}/v1/chat/completions", json={"model": MODEL, "messages": "x"}, headers=headers)
        httpx.post(
            f"{secured.base_url}/v1/chat/completions",
            content=b"{not json",
            headers={**headers, "content-type": "application/json"},
        )
        httpx.get(f"{secured.base_url}/v1/models/nothing", headers=headers)
        httpx.get(f"{secured.base_url}/v1/models")  # no key: 401, logged without a label
    lines = [line for line in logs if line.get("event") == "request"]
    assert [(line["status"], line["api_key"]) for line in lines] == [
        (400, "team-b"),
        (400, "team-b"),
        (404, "team-b"),
        (401, None),
    ]
    assert [line.get("error_code") for line in lines] == [
        "invalid_type",
        "invalid_json",
        "model_not_found",
        "invalid_api_key",
    ]
    assert all(LIMITED_KEY not in str(line) for line in lines)

"""``/ready`` as a load balancer reads it: a dead upstream that has a fallback keeps the pod in rotation, a model with
no ready target takes it out, and the reasons with addresses and error text are an operator's, not the public's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.config import GatewayConfig

from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from ..processes import free_port

ADMIN_KEY = "admin-key-0123456789"
CLIENT_KEY = "client-key-0123456789"


def _config(dead_url: str, models: list[dict[str, object]], **auth: object) -> GatewayConfig:
    """A reference backend ``r1`` and an LMDeploy backend ``dead`` whose node is down; ``auth``: the keys."""
    return GatewayConfig(
        server={"runtime": {"access_log": False}, "auth": auth},
        backends=[
            {"name": "r1", "kind": "reference"},
            # Probed once at start (refused: nothing listens there), then not again during the test.
            {"name": "dead", "kind": "lmdeploy", "urls": [dead_url], "health_interval": 3600},
        ],
        models=models,
    )


def _started(config: GatewayConfig) -> RunningGateway:
    running = start_gateway(config, wait_for="/health")
    assert wait_until(lambda: running.state.started, timeout=120), "the backends did not finish starting"
    return running


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def rescued(dead_url: str) -> Iterator[RunningGateway]:
    """Model ``fallback`` (``dead``, falling back to ``r1``) and ``plain`` (``r1``), behind client and admin keys."""
    config = _config(
        dead_url,
        [{"name": "fallback", "backends": ["dead"], "fallbacks": ["r1"]}, {"name": "plain", "backends": ["r1"]}],
        api_keys=[CLIENT_KEY],
        admin_api_key=ADMIN_KEY,
    )
    running = _started(config)
    yield running
    stop_gateway(running)


def _chat(running: RunningGateway, model: str) -> httpx.Response:
    return httpx.post(
        f"{running.base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        timeout=60,
    )


def test_a_dead_upstream_with_a_fallback_keeps_the_pod_ready_and_shows_in_the_body_and_metrics(
    rescued: RunningGateway,
) -> None:
    ready = httpx.get(f"{rescued.base_url}/ready")
    assert ready.status_code == 200, ready.text
    body = ready.json()
    assert body["status"] == "degraded"
    assert body["models"] == {
        "fallback": {"routable": True, "ready_backends": ["r1"]},
        "plain": {"routable": True, "ready_backends": ["r1"]},
    }
    assert body["backends"]["dead"]["ready"] is False and body["backends"]["r1"]["ready"] is True
    assert _chat(rescued, "fallback").status_code == 200
    assert _chat(rescued, "plain").status_code == 200
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    metrics = httpx.get(f"{rescued.base_url}/metrics", headers=admin).text
    assert 'gateway_backend_ready{backend="dead"} 0.0' in metrics
    assert 'gateway_backend_ready{backend="r1"} 1.0' in metrics


def test_strict_readiness_is_503_while_any_backend_is_down(rescued: RunningGateway) -> None:
    strict = httpx.get(f"{rescued.base_url}/ready", params={"strict": "true"})
    assert strict.status_code == 503
    assert strict.json()["status"] == "not_ready"
    assert httpx.get(f"{rescued.base_url}/ready", params={"strict": "false"}).status_code == 200


def test_a_bad_strict_value_is_a_400_naming_the_parameter(rescued: RunningGateway) -> None:
    response = httpx.get(f"{rescued.base_url}/ready", params={"strict": "maybe"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "strict"


def test_the_upstream_address_and_error_are_shown_only_with_the_admin_key(
    rescued: RunningGateway, dead_url: str
) -> None:
    for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}, {"Authorization": "Bearer wrong-key-0123456"}):
        public = httpx.get(f"{rescued.base_url}/ready", headers=headers)
        assert public.status_code == 200
        assert dead_url.removeprefix("http://") not in public.text and "127.0.0.1" not in public.text
        assert public.json()["backends"]["dead"]["reason"] == "not ready"
    admin = httpx.get(f"{rescued.base_url}/ready", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    reason = admin["backends"]["dead"]["reason"]
    assert dead_url in reason and "no healthy LMDeploy node" in reason


@pytest.fixture(scope="module")
def stranded(dead_url: str) -> Iterator[RunningGateway]:
    """``plain`` on ``r1`` and ``orphan`` on ``dead`` alone; client keys and no admin key."""
    config = _config(
        dead_url,
        [{"name": "plain", "backends": ["r1"]}, {"name": "orphan", "backends": ["dead"]}],
        api_keys=[CLIENT_KEY],
    )
    running = _started(config)
    yield running
    stop_gateway(running)


def test_a_model_with_no_ready_target_makes_ready_503(stranded: RunningGateway) -> None:
    ready = httpx.get(f"{stranded.base_url}/ready")
    assert ready.status_code == 503
    body = ready.json()
    assert body["status"] == "not_ready"
    assert body["models"]["orphan"] == {"routable": False, "ready_backends": []}
    assert body["models"]["plain"] == {"routable": True, "ready_backends": ["r1"]}
    assert _chat(stranded, "orphan").status_code == 503, "premise: the model really has no route"


def test_with_client_keys_and_no_admin_key_nobody_sees_the_upstream_detail(
    stranded: RunningGateway, dead_url: str
) -> None:
    for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):
        body = httpx.get(f"{stranded.base_url}/ready", headers=headers).text
        assert dead_url.removeprefix("http://") not in body and "LMDeploy" not in body

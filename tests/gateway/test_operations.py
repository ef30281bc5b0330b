"""Models, health, readiness and Prometheus metrics, as load balancers and operators use them."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig

from ..conformance import OpenAISchemas
from ..conftest import MODEL, TINY_MODEL, start_gateway, stop_gateway, wait_until


def test_models_lists_every_served_model_once(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL, TINY_MODEL]
    schemas.check("ListModelsResponse", http.get("/v1/models").json())
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    schemas.check("Model", http.get(f"/v1/models/{MODEL}").json())


def test_health_and_ready_report_ok_with_backend_detail(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["backends"]["reference"] == {
        "kind": "reference",
        "ready": True,
        "reason": "ready",
        "circuits": {MODEL: "closed"},
    }


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_requests_tokens_and_latencies_by_model_and_backend(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    labels = (("backend", "reference"), ("model", MODEL))
    before = _samples(http.get("/metrics").text)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    for _ in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "m"}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "w " * 500}])
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = _samples(response.text)

    def grew(name: str, extra: tuple[tuple[str, str], ...] = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("gateway_requests_total", (("status", "200"),)) == 2
    assert grew("gateway_generation_tokens_total") == 10
    assert grew("gateway_prompt_tokens_total") == 2 * completion.usage.prompt_tokens
    assert grew("gateway_time_to_first_token_seconds_count") == 2
    assert grew("gateway_time_per_output_token_seconds_count") == 2
    assert grew("gateway_e2e_request_latency_seconds_count") == 2
    tiny = (("backend", "tiny"), ("model", TINY_MODEL), ("status", "400"))
    assert after[("gateway_requests_total", tuple(sorted(tiny)))] >= 1
    assert after[("gateway_requests_in_flight", labels)] == 0
    assert ("gateway_time_to_first_token_seconds_bucket", tuple(sorted((*labels, ("le", "0.005"))))) in after
    assert after[("gateway_backend_ready", (("backend", "reference"),))] == 1
    assert after[("gateway_engine_steps_total", (("backend", "reference"),))] > 0
    assert ("gateway_gc_collections_total", (("generation", "0"),)) in after


class _SlowStartBackend:
    """A backend whose start blocks until the test releases it, to observe readiness while starting."""

    kind = "test-double"

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = threading.Event()
        self.started = False

    async def start(self) -> None:
        await asyncio.to_thread(self.release.wait, 30)
        self.started = True

    async def stop(self) -> None:
        self.release.set()

    def readiness(self) -> tuple[bool, str]:
        return (True, "ready") if self.started else (False, "starting")

    def max_model_len(self) -> int | None:
        return None

    def generate(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_ready_is_503_until_every_backend_started_while_health_is_200() -> None:
    slow = _SlowStartBackend("slow")
    config = GatewayConfig(
        backends=[{"name": "slow", "kind": "reference"}], models=[{"name": "m", "backends": ["slow"]}]
    )
    running = start_gateway(config, backends={"slow": slow}, wait_for="/health")
    try:
        assert httpx.get(f"{running.base_url}/health").status_code == 200
        not_ready = httpx.get(f"{running.base_url}/ready")
        assert not_ready.status_code == 503
        assert not_ready.json()["status"] == "starting"
        assert not_ready.json()["backends"]["slow"]["reason"] == "starting"
        refused = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 503
        assert refused.headers["retry-after"]
        slow.release.set()
        assert wait_until(lambda: httpx.get(f"{running.base_url}/ready").status_code == 200)
    finally:
        stop_gateway(running)


def test_backend_that_cannot_start_leaves_the_process_serving_and_ready_says_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = GatewayConfig(
        backends=[
            {"name": "ref", "kind": "reference"},
            {"name": "gpu", "kind": "deepinfer", "model": str(tmp_path / "no-such-model"), "max_model_len": 8192},
        ],
        models=[{"name": "a", "backends": ["ref"]}, {"name": "b", "backends": ["gpu"]}],
    )
    running = start_gateway(config, wait_for="/health")
    try:
        assert wait_until(lambda: running.state.backends["ref"].readiness()[0], timeout=60)
        assert wait_until(lambda: "gpu" in running.state.start_errors, timeout=60)
        ready = httpx.get(f"{running.base_url}/ready")
        assert ready.status_code == 503
        assert "no-such-model" in ready.json()["backends"]["gpu"]["reason"]
        served = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        )
        assert served.status_code == 200
        unavailable = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json={"model": "b", "messages": [{"role": "user", "content": "x"}]},
        )
        assert unavailable.status_code == 503
        assert unavailable.json()["error"]["type"] == "server_error"
    finally:
        stop_gateway(running)

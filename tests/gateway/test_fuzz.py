"""Fuzzing the HTTP API with schemathesis against the app's own OpenAPI: no client mistake is a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from ..conftest import TINY_MODEL, RunningGateway

POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
CASES = [
    ("POST /v1/chat/completions", POSITIVE),
    ("POST /v1/chat/completions", NEGATIVE),
    ("POST /v1/completions", POSITIVE),
    ("POST /v1/completions", NEGATIVE),
    ("POST /v1/responses", POSITIVE),
    ("POST /v1/responses", NEGATIVE),
    ("GET /v1/models/{model_id}", POSITIVE),
    ("GET /v1/models", POSITIVE),
    ("GET /health", POSITIVE),
    ("GET /metrics", POSITIVE),
]  # negative cases only where the operation has inputs to break


@pytest.fixture(scope="module")
def api_schema(gateway: RunningGateway) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{gateway.base_url}/openapi.json")


def _operation(schema: schemathesis.BaseSchema, label: str):  # type: ignore[no-untyped-def]
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label == label:
            return operation
    raise AssertionError(f"{label} is not in the app's OpenAPI document")


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_no_generated_request_gets_a_server_error(
    api_schema: schemathesis.BaseSchema, gateway: RunningGateway, label: str, mode: schemathesis.GenerationMode
) -> None:
    operation = _operation(api_schema, label)
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # A served model (with a small context, so generation stays short) reaches the engine paths.
            case.body["model"] = TINY_MODEL
        response = case.call(base_url=gateway.base_url, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
        if response.status_code >= 400:
            error = response.json().get("error")
            assert isinstance(error, dict) and error.get("message"), response.text[:500]

    check()
    assert seen, "the fuzzer sent requests"


def test_openapi_documents_the_generation_request_bodies(gateway: RunningGateway) -> None:
    spec = httpx.get(f"{gateway.base_url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert "requestBody" in spec["paths"][path]["post"]

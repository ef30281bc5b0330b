"""Routing across backend kinds: a reference engine and a real LMDeploy api_server (the harness node, stub
engine) behind the same model names. The node fails requests on demand (``[[stub fail=... after=N]]`` in the
prompt), so fallback before the first token and no fallback after it are shown on a real upstream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig

from ..backends.lmdeploy.harness.server import API_KEY, MODEL_NAME, HarnessNode, make_node
from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from .test_routing import _assert_whole_answer, _chat, _data_frames, _served_by, _shadow, _targets

FAIL_BEFORE_FIRST_TOKEN = "[[stub fail=INTERNAL_ENGINE_ERROR after=0 tag=routing-fallback]]"
FAIL_AFTER_TWO_TOKENS = "[[stub fail=INTERNAL_ENGINE_ERROR after=2]]"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessNode]:
    workdir: Path = tmp_path_factory.mktemp("routing-lmdeploy")
    started = make_node(
        workdir, "routing", "--model-name", MODEL_NAME, "--session-len", "256", "--api-keys", API_KEY
    ).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def mixed(node: HarnessNode) -> Iterator[RunningGateway]:
    lm = {"name": "lm", "kind": "lmdeploy", "urls": [node.url], "api_key": API_KEY, "max_model_len": 256}
    config = GatewayConfig(
        backends=[{"name": "ref", "kind": "reference"}, lm],
        models=[
            {"name": "both", "backends": ["ref", "lm"], "allow_pin_header": True},
            {"name": "lm-first", "backends": ["lm"], "fallbacks": ["ref"]},
            {"name": "ref-shadowed", "backends": ["ref"], "shadow": {"backend": "lm", "fraction": 1.0}},
            {"name": "ref-only", "backends": ["ref"]},
        ],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def http(mixed: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mixed.base_url, timeout=60) as client:
        yield client


def test_one_model_lists_both_kinds_and_pins_to_either(http: httpx.Client) -> None:
    kinds = {m["id"]: m["backend_kinds"] for m in http.get("/v1/models").json()["data"]}
    assert kinds["both"] == ["reference", "lmdeploy"] and kinds["ref-shadowed"] == ["reference"]
    for backend in ("ref", "lm", "ref", "lm"):
        response = _chat(http, "both", "Hello there", max_tokens=4, headers={"X-Backend": backend})
        assert _served_by(response) == backend
        assert response.json()["choices"][0]["message"]["content"]


def test_an_lmdeploy_engine_failure_before_the_first_token_falls_back_to_the_reference_engine(
    http: httpx.Client, node: HarnessNode
) -> None:
    for stream in (False, True):
        response = _chat(http, "lm-first", f"Hello {FAIL_BEFORE_FIRST_TOKEN}", max_tokens=4, stream=stream)
        assert _served_by(response) == "ref"
        _assert_whole_answer(response, stream)
    assert _targets(http, "lm-first")["lm"]["failures"] == 2
    assert len(node.events(event="fail", tag="routing-fallback")) == 2, "the node really got and failed them"
    assert _served_by(_chat(http, "lm-first", "Hello again", max_tokens=4)) == "lm"


def test_an_lmdeploy_failure_after_the_first_token_is_an_error_frame_not_a_second_answer(http: httpx.Client) -> None:
    response = _chat(http, "lm-first", f"Hello world again {FAIL_AFTER_TWO_TOKENS}", max_tokens=16, stream=True)
    assert _served_by(response) == "lm"
    frames = _data_frames(response)
    assert frames[-1] == "[DONE]" and frames[-2]["error"]["type"] == "server_error"
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames[:-2])
    assert text == "Hello world", "only what the LMDeploy node sent before failing"
    assert _targets(http, "lm-first")["ref"]["requests"] == 2, "the reference fallback was not asked again"


def test_lmdeploy_shadow_of_reference_traffic_is_compared_and_never_reaches_the_client(http: httpx.Client) -> None:
    body = {"max_tokens": 8, "temperature": 0}
    for i in range(3):
        shadowed = _chat(http, "ref-shadowed", f"Hello number {i}", **body)
        alone = _chat(http, "ref-only", f"Hello number {i}", **body)
        assert _served_by(shadowed) == "ref"
        assert shadowed.json()["choices"] == alone.json()["choices"]
    assert wait_until(lambda: _shadow(http, "ref-shadowed")["outcomes"].get("compared") == 3)
    summary = _shadow(http, "ref-shadowed")["comparisons"]["ref"]
    assert summary["greedy"] == 3
    assert summary["text"]["match"] + summary["text"]["mismatch"] == 3
    assert summary["ttft_ms"]["shadow"] is not None

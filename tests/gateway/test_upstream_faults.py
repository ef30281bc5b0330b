"""Faults of an HTTP upstream (LMDeploy's real api_server in the test harness): killed mid-stream, or hanging.

The client always gets a clean OpenAI error, the gateway stays up, and hung upstream work is cancelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.config import GatewayConfig

from ..backends.lmdeploy.harness.server import API_KEY, MODEL_NAME, HarnessNode, make_node
from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_until

MODEL = "upstream"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessNode]:
    workdir: Path = tmp_path_factory.mktemp("upstream-faults")
    started = make_node(workdir, "faults", "--model-name", MODEL_NAME, "--api-keys", API_KEY).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def fronted(node: HarnessNode) -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "lm", "kind": "lmdeploy", "urls": [node.url], "api_key": API_KEY, "max_model_len": 512}],
        models=[{"name": MODEL, "backends": ["lm"], "circuit_breaker": {"failure_threshold": 1000}}],
    )
    config.server.streams.idle_timeout = 1.0
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def _chat(content: str, **fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 64, **fields}


def test_hanging_upstream_gets_a_504_and_its_request_is_cancelled(fronted: RunningGateway, node: HarnessNode) -> None:
    response = httpx.post(
        f"{fronted.base_url}/v1/chat/completions", json=_chat("a b c [[stub first_delay=60 tag=hang]]"), timeout=30
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert wait_until(lambda: node.events(event="cancel", tag="hang"), timeout=15)


def test_an_upstream_quiet_mid_stream_past_the_idle_timeout_ends_the_stream_with_a_timeout_frame(
    fronted: RunningGateway, node: HarnessNode
) -> None:
    """After its first tokens the upstream says nothing for a minute: one second (idle_timeout) later the stream
    ends with a timeout error frame and [DONE], and the upstream request is cancelled."""
    body = _chat("one two three [[stub pause=60 pause_after=1 tag=quiet-mid]]", stream=True)
    with httpx.stream("POST", f"{fronted.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert orjson.loads(data[0])["choices"], "tokens flowed before the upstream went quiet"
    error = orjson.loads(data[-2])["error"]
    assert error["code"] == "timeout"
    assert wait_until(lambda: node.events(event="cancel", tag="quiet-mid"), timeout=15)


def test_upstream_killed_mid_stream_ends_the_stream_with_an_error_frame_and_the_gateway_stays_up(
    fronted: RunningGateway, node: HarnessNode
) -> None:
    body = _chat("one two three four five six seven eight nine ten [[stub delay=0.3 tag=killed]]", stream=True)
    frames: list[str] = []
    with httpx.stream("POST", f"{fronted.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if len(frames) == 2:
                    node.kill()
    assert frames[-1] == "[DONE]"
    error = orjson.loads(frames[-2])["error"]
    assert error["type"] == "server_error" and error["message"]
    assert httpx.get(f"{fronted.base_url}/health").status_code == 200
    node.start()  # the node comes back on its port; the backend takes it in again
    assert wait_until(lambda: httpx.get(f"{fronted.base_url}/ready").status_code == 200, timeout=60)
    again = httpx.post(f"{fronted.base_url}/v1/chat/completions", json=_chat("hello there"), timeout=30)
    assert again.status_code == 200


def test_a_stream_that_goes_quiet_gets_pings_and_then_its_remaining_frames(node: HarnessNode) -> None:
    """The upstream pauses after its first token for 60 ping intervals: comment frames keep the connection busy
    for proxies, and the stream then carries on. The pause ends the wait, not a clock in the test."""
    config = GatewayConfig(
        backends=[{"name": "lm", "kind": "lmdeploy", "urls": [node.url], "api_key": API_KEY, "max_model_len": 512}],
        models=[{"name": MODEL, "backends": ["lm"]}],
    )
    config.server.streams.ping_seconds = 0.05
    running = start_gateway(config)
    try:
        body = _chat("one two three [[stub pause=3 pause_after=1 tag=quiet]]", stream=True)
        lines: list[str] = []
        with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
    finally:
        stop_gateway(running)
    data = [i for i, line in enumerate(lines) if line.startswith("data: {")]
    pings = [i for i, line in enumerate(lines) if line == ": ping"]
    assert len(data) >= 3 and lines[-1] == "data: [DONE]"
    assert pings and data[0] < pings[0] < data[1], "no ping while the upstream was quiet"
    text = "".join(orjson.loads(lines[i][6:])["choices"][0]["delta"].get("content") or "" for i in data)
    assert text.startswith("one two three")


@pytest.fixture(scope="module")
def read_limited(node: HarnessNode) -> Iterator[RunningGateway]:
    """No gateway idle limit: only the LMDeploy backend's own silence limit (``read_timeout``) can end a stream."""
    config = GatewayConfig(
        backends=[
            {
                "name": "lm",
                "kind": "lmdeploy",
                "urls": [node.url],
                "api_key": API_KEY,
                "max_model_len": 512,
                "read_timeout": 1.0,
            }
        ],
        models=[{"name": MODEL, "backends": ["lm"], "circuit_breaker": {"failure_threshold": 1000}}],
    )
    config.server.idle_timeout = None
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_an_upstream_quiet_past_the_backend_s_read_timeout_ends_the_stream_and_is_cancelled(
    read_limited: RunningGateway, node: HarnessNode
) -> None:
    body = _chat("one two three [[stub pause=60 pause_after=1 tag=quiet-read]]", stream=True)
    with httpx.stream("POST", f"{read_limited.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert orjson.loads(data[0])["choices"], "tokens flowed before the upstream went quiet"
    error = orjson.loads(data[-2])["error"]
    assert error["code"] == "timeout", error
    assert wait_until(lambda: node.events(event="cancel", tag="quiet-read"), timeout=15)

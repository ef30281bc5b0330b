"""Frames go out as the backend produces them: a stream writes what was ready in one send, but never holds a
frame back to wait for more (checked against the engine's own token count, on an engine with a timing model); the
step that ends a stream goes out with the stream's end frames, in one write."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.config import GatewayConfig
from gateway.connections import DirectBody

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until

MAX_BURST = 64  # tokens a stream that held frames back to fill a batch would wait for
STEP = 0.05  # seconds per decode step: MAX_BURST steps take 3.2 s, far longer than a frame takes to arrive


@pytest.fixture(scope="module")
def paced_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_each_frame_reaches_the_client_while_the_engine_is_still_generating(
    paced_gateway: RunningGateway, path: str
) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 4 * MAX_BURST, "ignore_eos": True, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "go on"}]
    else:
        body["prompt"] = "go on"
    before = paced_gateway.engine_tokens()
    generated_when_read: list[int] = []
    with (
        httpx.Client(base_url=paced_gateway.base_url, timeout=60) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                orjson.loads(line[6:])
                generated_when_read.append(paced_gateway.engine_tokens() - before)
                if len(generated_when_read) == 4:
                    break
    # Frames held back until a burst filled would only arrive once MAX_BURST tokens were generated.
    assert max(generated_when_read) < MAX_BURST, generated_when_read
    assert wait_until(paced_gateway.engine_idle)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_streams_last_frames_and_its_end_go_out_in_one_write(
    paced_gateway: RunningGateway, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step that ends a stream costs one socket write, not one for its frames and another for the end. The
    connection's direct writes are recorded (the real ones still happen): each chunk the socket took."""
    written: list[bytes] = []
    real_write = DirectBody.write

    def recorded(self: DirectBody, chunk: bytes) -> bool:
        took = real_write(self, chunk)
        if took:
            written.append(chunk)
        return took

    monkeypatch.setattr(DirectBody, "write", recorded)
    body: dict[str, object] = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "go on"}]
    else:
        body["prompt"] = "go on"
    with httpx.Client(base_url=paced_gateway.base_url, timeout=60) as http:
        frames = [line for line in http.post(path, json=body).text.split("\n\n") if line]
    assert frames[-1] == "data: [DONE]" and '"finish_reason":"length"' in frames[-2]
    assert len(written) > 1  # the steps before the last went out as they came
    last = written[-1].decode()
    assert last.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in last

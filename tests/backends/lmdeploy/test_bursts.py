"""Chunks that reach the gateway in one network read go on as one event: one SSE frame to a streaming client, one
step of the whole-response collector, with all of their text.

A node's chunks pile up in one read whenever the gateway reads slower than the node writes (a busy event loop),
but LMDeploy's real api_server cannot be made to do that on cue. The node here is therefore a test double: the
benchmark's fake upstream (``gateway.bench.fake_upstream``, LMDeploy's chunk format), which with no pace writes a
whole stream in one write, and a write on loopback is one read.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until

TOKENS = 16


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def one_write_node() -> Iterator[str]:
    """Test double of an LMDeploy node that writes each stream in one write (see the module docstring)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "gateway.bench.fake_upstream", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(url), timeout=30), "the fake upstream did not start"
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def fronted(one_write_node: str) -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "burst", "kind": "lmdeploy", "urls": [one_write_node], "model": "fake"}],
        models=[{"name": "fake", "backends": ["burst"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_chunks_read_together_reach_a_streaming_client_as_one_frame_with_all_their_text(
    fronted: RunningGateway,
) -> None:
    client = openai.OpenAI(base_url=f"{fronted.base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "go"}],
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts == [" tok" * TOKENS], "the node's 16 chunks arrived in one read"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS


def test_a_whole_response_from_chunks_read_together_holds_all_their_text(fronted: RunningGateway) -> None:
    client = openai.OpenAI(base_url=f"{fronted.base_url}/v1", api_key="unused")
    completion = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "go"}], max_tokens=TOKENS
    )
    assert completion.choices[0].message.content == " tok" * TOKENS
    assert completion.choices[0].finish_reason == "length"

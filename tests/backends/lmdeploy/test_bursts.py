"""Chunks that reach the gateway in one network read go on as one event: one SSE frame to a streaming client, one
step of the whole-response collector, with all of their text.

A node's chunks pile up in one read whenever the gateway reads slower than the node writes (a busy event loop),
but LMDeploy's real api_server cannot be made to do that on cue. The nodes here are therefore test doubles that
write a whole stream in one write (a write on loopback is one read): the benchmark's fake upstream
(``loadgen.fake_upstream``, LMDeploy's chunk format) behind a real gateway, and ``OneWriteNode`` for a
stream the fake cannot send (an engine error frame after two tokens).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from backends.errors import UpstreamError
from backends.interface import Delta, Event, GenerateRequest
from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from ...processes import free_port
from .conftest import running_backend

TOKENS = 16


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def one_write_node() -> Iterator[str]:
    """Test double of an LMDeploy node that writes each stream in one write (see the module docstring)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "loadgen.fake_upstream", "--port", str(port)])
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


def _sse(payload: dict[str, Any]) -> bytes:
    """One SSE event as one HTTP chunk, as LMDeploy's api_server writes them."""
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _text_chunk(text: str) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}


class OneWriteNode:
    """Test double of an LMDeploy node in the test's own event loop: ``/health`` answers as LMDeploy's does, and
    every other request gets ``body`` (an SSE stream, chunked) in one write."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if head.startswith(b"GET /health"):
                    body = b'{"status": "healthy"}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(body), body)
                    )
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                        + self.body
                    )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_bad_chunk_read_together_with_good_ones_still_comes_after_their_text() -> None:
    """An engine error frame in the same read as two tokens: the tokens go out first, then the error (after the
    first token there is no failover, so the client gets its text and an error frame, as when they come apart)."""
    error = {"error": {"message": "engine failed", "type": "internal_error", "code": 500}}
    body = _sse(_text_chunk("Hello")) + _sse(_text_chunk(" world")) + _sse(error) + b"0\r\n\r\n"
    request = GenerateRequest(request_id="bad-chunk", model="m", messages=[{"role": "user", "content": "hi"}])
    events: list[Event] = []
    async with OneWriteNode(body) as url, running_backend([url], model="m") as backend:
        with pytest.raises(UpstreamError):
            async for event in backend.generate(request):
                events.append(event)
    assert [e.text for e in events if isinstance(e, Delta)] == ["Hello world"]

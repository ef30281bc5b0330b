"""Several LMDeploy nodes: least-outstanding choice, failover before the first byte, nodes that sleep, die, return."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.errors import UpstreamError
from backends.interface import Delta, Finish, Usage

from ...waiting import until
from .conftest import running_backend
from .harness.server import API_KEY, MODEL_NAME, HarnessNode, make_node
from .test_backend import chat, collect, text_of

NODE_ARGS = ("--model-name", MODEL_NAME, "--session-len", "256", "--api-keys", API_KEY)


@pytest.fixture(scope="module")
def pair(harness_dir: Path, model_dir: Path) -> Iterator[tuple[HarnessNode, HarnessNode]]:
    a = make_node(harness_dir / "pair", "a", *NODE_ARGS, model_dir=model_dir)
    b = make_node(harness_dir / "pair", "b", *NODE_ARGS, model_dir=model_dir)
    a.launch()
    b.launch()
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        a.stop()
        b.stop()


async def test_concurrent_requests_go_to_the_node_with_fewest_outstanding(
    pair: tuple[HarnessNode, HarnessNode],
) -> None:
    a, b = pair
    async with running_backend([a.url, b.url]) as backend:
        requests = [chat("one two three four [[stub delay=0.05 tag=spread]]") for _ in range(4)]
        results = await asyncio.gather(*(collect(backend, r) for r in requests))
    assert all(text_of(events) == "one two three four" for events in results)
    assert len(a.events(event="start", tag="spread")) == 2
    assert len(b.events(event="start", tag="spread")) == 2


async def test_engine_failure_before_the_first_token_fails_over_to_another_node(
    pair: tuple[HarnessNode, HarnessNode],
) -> None:
    a, b = pair
    async with running_backend([a.url, b.url], failure_threshold=100) as backend:
        for _ in range(4):
            events = await collect(backend, chat("Hello [[stub fail=INTERNAL_ENGINE_ERROR after=0 fail_on=a tag=fo]]"))
            assert text_of(events) == "Hello" and isinstance(events[-1], Usage)
        failovers = backend.pool.nodes[0].retries_away
    assert a.events(event="fail", tag="fo"), "some requests went to the failing node first"
    assert len(b.events(event="finish", tag="fo")) == 4, "and every one was served by the other node"
    assert failovers == len(a.events(event="fail", tag="fo"))


async def test_no_failover_once_output_reached_the_gateway(pair: tuple[HarnessNode, HarnessNode]) -> None:
    a, b = pair
    seen = []
    async with running_backend([a.url, b.url], failure_threshold=100) as backend:
        with pytest.raises(UpstreamError):
            async for event in backend.generate(
                chat("Hello world again [[stub fail=INTERNAL_ENGINE_ERROR after=2 tag=late]]")
            ):
                seen.append(event)
    assert text_of(seen) == "Hello world"
    assert len(a.events(event="start", tag="late")) + len(b.events(event="start", tag="late")) == 1


async def test_a_sleeping_node_is_failed_over_and_taken_out_until_it_wakes(
    pair: tuple[HarnessNode, HarnessNode],
) -> None:
    a, b = pair
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with running_backend([a.url, b.url], failure_threshold=2, health_interval=0.2) as backend:
        async with httpx.AsyncClient(headers=headers) as admin:
            assert (await admin.post(f"{a.url}/sleep", json={})).status_code == 200
        try:
            for _ in range(4):  # LMDeploy answers 503 on the sleeping node: each such request moves to b
                events = await collect(backend, chat("Hi [[stub tag=sleepy]]"))
                assert text_of(events) == "Hi"
            node_a = backend.pool.nodes[0]
            assert node_a.errors.get("unavailable", 0) >= 1
            assert not node_a.healthy, "two failed requests took it out"
            assert len(b.events(event="finish", tag="sleepy")) == 4
        finally:
            async with httpx.AsyncClient(headers=headers) as admin:
                assert (await admin.post(f"{a.url}/wakeup", json={})).status_code == 200
        assert await until(lambda: backend.pool.nodes[0].healthy, 30), "the next good /health probe brings it back"


async def test_a_dead_node_is_taken_out_and_brought_back_when_healthy(pair: tuple[HarnessNode, HarnessNode]) -> None:
    a, b = pair
    async with running_backend([a.url, b.url], health_interval=0.2) as backend:
        a.kill()
        for _ in range(3):
            events = await collect(backend, chat("Hi [[stub tag=dead]]"))
            assert text_of(events) == "Hi"
        assert not backend.pool.nodes[0].healthy
        assert backend.readiness() == (True, "1/2 LMDeploy nodes healthy")
        assert "unreachable" in backend.pool.nodes[0].reason or "connect" in backend.pool.nodes[0].reason
        assert len(b.events(event="finish", tag="dead")) == 3
        a.start()
        assert await until(lambda: backend.pool.nodes[0].healthy, 30)
        results = await asyncio.gather(*(collect(backend, chat("Hi [[stub delay=0.05 tag=back]]")) for _ in range(2)))
        assert all(isinstance(events[-2], Finish) and isinstance(events[0], Delta) for events in results)
    assert len(a.events(event="finish", tag="back")) == 1, "the returned node takes requests again"

"""A finished request leaves no reference cycle behind: every object the gateway made for it is freed by reference
counting the moment it is done with, never by the cycle collector.

A cycle through one object of a request keeps all the others alive with it, so each request's whole object graph
(its tasks, its stream, its engine run, its parser) waited for a collection, and the collections went through
them: on a loaded front end that was about 2.2 µs of CPU per streamed token, a seventh of the gateway's CPU
(docs/bench.md, "Garbage, spinning threads and one write less"). The cycles came from a caught
``StopAsyncIteration`` kept with its traceback, a cancelled watcher task that its owner still held, a bound method
of the owner given to what it owns, the connection's direct writer and its request cycle holding each other, and a
response and its body holding each other's methods.

The requests run on the timed reference engine, so a stream takes several engine steps and its frames go out
through the writer that engine steps wake, and a client can leave in the middle of one; the collector is told to
keep what it finds (``DEBUG_SAVEALL``), and what it found of the gateway's and the backends' objects is listed."""

from __future__ import annotations

import gc
from collections import Counter

import httpx
import openai
import pytest

from ..conftest import MODEL, RunningGateway, wait_until


@pytest.fixture
def timed_client(timed_gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{timed_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def ours(garbage: list[object]) -> Counter[str]:
    """The gateway's and the backends' objects among ``garbage``, counted by type."""
    return Counter(
        f"{type(thing).__module__}.{type(thing).__qualname__}"
        for thing in garbage
        if type(thing).__module__.partition(".")[0] in ("gateway", "backends")
    )


def serve(client: openai.OpenAI, times: int) -> None:
    """Streamed and whole chat completions, a streamed completion and a streamed Responses answer, ``times`` each."""
    for _ in range(times):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
        )
        assert [chunk for chunk in chat if chunk.choices and chunk.choices[0].finish_reason]
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert whole.choices[0].finish_reason in ("stop", "length")
        completion = client.completions.create(model=MODEL, prompt="def", max_tokens=12, stream=True)
        assert [chunk for chunk in completion if chunk.choices[0].finish_reason]
        response = client.responses.create(model=MODEL, input="hi", max_output_tokens=12, stream=True, store=False)
        assert [event.type for event in response][-1] in ("response.completed", "response.incomplete")


def test_finished_requests_leave_no_reference_cycles(
    timed_gateway: RunningGateway, timed_client: openai.OpenAI, collected_garbage: list[object]
) -> None:
    serve(timed_client, 1)  # what a gateway builds on its first requests stays, and is no garbage
    gc.collect()
    collected_garbage.clear()
    serve(timed_client, 3)
    gc.collect()
    assert ours(collected_garbage) == Counter()


def leave_mid_stream(gateway: RunningGateway, times: int) -> None:
    """Streams that the client stops reading after a few frames and closes, each until the engine is idle again."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000, "ignore_eos": True}
    for _ in range(times):
        with (
            httpx.Client(base_url=gateway.base_url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
        ):
            frames = [line for _, line in zip(range(4), response.iter_lines(), strict=False)]
            assert frames[0].startswith("data: {")
        assert wait_until(gateway.engine_idle)


def test_a_client_that_leaves_mid_stream_leaves_no_reference_cycles(
    timed_gateway: RunningGateway, collected_garbage: list[object]
) -> None:
    leave_mid_stream(timed_gateway, 1)
    gc.collect()
    collected_garbage.clear()
    leave_mid_stream(timed_gateway, 3)
    gc.collect()
    assert ours(collected_garbage) == Counter()

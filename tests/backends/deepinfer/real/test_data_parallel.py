"""Data parallelism on DeepInfer's real engine: the gateway with two DeepInfer ranks in worker processes, meeting over
gloo, stepping in lockstep (idle ranks run DeepInfer's placeholder steps), driven with the openai SDK and raw HTTP.

The stub model takes ``FORWARD_SECONDS`` per forward (``DEEPINFER_HARNESS_FORWARD_SECONDS``), so a request of a few
hundred tokens is still running when a test acts on it. The tests read the dispatcher's per-rank state
(``driver.ranks``) to see where requests went.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from ....conftest import RunningGateway, captured_logs, logged_error_detail, stop_gateway, wait_until
from ...workers.conftest import (
    chat,
    driver_of,
    holding_rank,
    one_model_per_backend,
    open_stream,
    start_with_ranks,
    steps,
    worker_pids,
)
from .conftest import ENGINE_ENV

MODEL = "di2"
MAX_MODEL_LEN = 1024
FORWARD_SECONDS = "0.003"
DP_ENV = {**ENGINE_ENV, "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1"}
"""The documented DP setting (deploy/config/deepinfer.yaml): a rank prefills at once even when its peers are idle."""


def start(model_dir: Path) -> RunningGateway:
    """A gateway with one backend of two DeepInfer ranks (worker processes on this harness interpreter)."""
    backend: dict[str, Any] = {
        "name": MODEL,
        "kind": "deepinfer",
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        "data_parallel_size": 2,
        "visible_devices": "0,1",
        "env": DP_ENV,
    }
    return start_with_ranks(one_model_per_backend([backend]), ready_timeout=120)


class Group:
    """The module's two-rank gateway, started when first needed; the shutdown test takes it (and stops it), so a
    test that runs after that gets a new one: every test sees a live group, in any order, and in file order the
    module starts one gateway (plus the group restart the killed-rank test causes)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.running: RunningGateway | None = None

    def live(self) -> RunningGateway:
        if self.running is None:
            self.running = start(self.model_dir)
        return self.running

    def take(self) -> RunningGateway:
        running, self.running = self.live(), None
        return running

    def stop(self) -> None:
        if self.running is not None:
            stop_gateway(self.running)
            self.running = None


@pytest.fixture(scope="module")
def group(real_model_dir: Path) -> Iterator[Group]:
    """Rank workers inherit this process's environment: the stub model's forward time is set for the module."""
    saved = dict(os.environ)
    os.environ["DEEPINFER_HARNESS_FORWARD_SECONDS"] = FORWARD_SECONDS
    holder = Group(real_model_dir)
    yield holder
    holder.stop()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def served(group: Group) -> RunningGateway:
    return group.live()


@pytest.fixture
def http(served: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        yield client


def client_of(served: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_sample(gateway: RunningGateway, rank: int, name: str) -> float | None:
    samples = {s[0]: s for s in driver_of(gateway, MODEL).ranks[rank].samples}
    return float(samples[name][3]) if name in samples else None


def test_two_data_parallel_ranks_serve_requests_in_lockstep_over_gloo(served: RunningGateway) -> None:
    client = client_of(served)
    prompts = [f"alpha beta {word}" for word in ("gamma", "delta", "epsilon", "zeta")]
    for prompt in prompts:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=50)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (prompt, "stop")
    reply = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=50)
    assert sorted(choice.text for choice in reply.choices) == sorted(prompts[:2])


def test_openai_sdk_streams_through_the_data_parallel_backend(served: RunningGateway) -> None:
    chunks = list(
        client_of(served).completions.create(model=MODEL, prompt="one two three four", max_tokens=50, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "one two three four"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_requests_spread_over_the_ranks_and_come_back_right(served: RunningGateway, http: httpx.Client) -> None:
    before = [r.dispatched for r in driver_of(served, MODEL).ranks]
    for i in range(6):
        reply = chat(http, MODEL, f"alpha beta request number {i}", 4)
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 4
    after = [r.dispatched for r in driver_of(served, MODEL).ranks]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3], "equal loads rotate over the ranks"


def test_idle_ranks_step_in_lockstep_with_the_busy_one(served: RunningGateway, http: httpx.Client) -> None:
    driver = driver_of(served, MODEL)
    start_steps = steps(served, MODEL)
    dispatched = [r.dispatched for r in driver.ranks]
    with open_stream(http, MODEL, 60) as stream:
        rest = list(stream)
    assert rest[-1] == "[DONE]" and orjson.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    (busy,) = [r.index for r in driver.ranks if r.dispatched == dispatched[r.index] + 1]
    assert [r.outstanding for r in driver.ranks] == [0, 0]
    # Every rank reports the same step count (the idle one ran DeepInfer's placeholder steps), at least the busy
    # rank's 60.
    assert wait_until(lambda: len(set(steps(served, MODEL))) == 1 and steps(served, MODEL)[busy] > start_steps[busy])
    assert steps(served, MODEL)[0] - start_steps[0] >= 60
    assert all(r.state == "up" and r.restarts == 0 for r in driver.ranks), "no rank failed a collective"


def test_abort_reaches_the_rank_that_holds_the_request(served: RunningGateway, http: httpx.Client) -> None:
    before = [engine_sample(served, i, "engine_aborted_requests") or 0.0 for i in range(2)]
    with open_stream(http, MODEL, 900) as stream:
        next(stream)
        holder = holding_rank(served, MODEL)
    # The client went away mid-stream: the dispatcher aborts the request on its rank's engine, no other.
    driver = driver_of(served, MODEL)
    assert wait_until(lambda: driver.ranks[holder].outstanding == 0)
    assert wait_until(lambda: (engine_sample(served, holder, "engine_aborted_requests") or 0.0) == before[holder] + 1)
    assert engine_sample(served, 1 - holder, "engine_aborted_requests") == before[1 - holder]


def test_a_killed_rank_restarts_the_whole_group_and_its_requests_fail_cleanly(
    served: RunningGateway, http: httpx.Client
) -> None:
    """The peer of a killed rank is stuck in a gloo collective (DeepInfer's timeout is hours): the dispatcher
    restarts the whole group, and the request on the killed rank ends with an error event."""
    driver = driver_of(served, MODEL)
    old_pids = [r.pid for r in driver.ranks]
    with captured_logs(served) as logs, open_stream(http, MODEL, 900) as stream:
        next(stream)
        victim = driver.ranks[holding_rank(served, MODEL)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        rest = list(stream)
    assert rest[-1] == "[DONE]"
    assert orjson.loads(rest[-2])["error"]["type"] == "server_error"
    detail = logged_error_detail(logs)  # the client's message is generic; the log has the detail
    assert f"data-parallel rank {victim.index}" in detail or "lockstep group restart" in detail
    assert wait_until(lambda: all(r.state == "up" for r in driver.ranks), timeout=120)
    new_pids = [r.pid for r in driver.ranks]
    assert not set(new_pids) & set(old_pids), "the peer, stuck in a collective, was restarted with the victim"
    assert chat(http, MODEL, "the group is back", 5)["choices"][0]["finish_reason"] == "length"


def test_shutdown_closes_every_rank_together_and_leaves_no_process(group: Group) -> None:
    running = group.take()
    driver = driver_of(running, MODEL)
    processes = [r.process for r in driver.ranks]
    assert all(p is not None for p in processes)
    assert {p.pid for p in processes if p is not None} <= worker_pids(os.getpid())
    chat(httpx.Client(base_url=running.base_url, timeout=30), MODEL, "one request before stopping", 3)
    stop_gateway(running)
    # Exit status 0: every rank left its loop through the stop agreement and returned from DeepInfer's close(),
    # whose two barriers are real gloo collectives (a rank closing alone would hang there, then fail).
    assert [p.wait(timeout=60) for p in processes if p is not None] == [0, 0]
    assert not {p.pid for p in processes if p is not None} & worker_pids(os.getpid()), "no worker left behind"

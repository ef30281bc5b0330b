"""Several front ends (dispatchers) in front of one set of rank workers.

The ranks are real worker processes (``python -m backends.workers.worker``) on ipc endpoints; each front end is a
gateway (in-process, or a ``gateway.cli serve`` process where one must be killed) that reaches them through
``worker_endpoints``, as the front-end supervisor's processes do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import yaml

from backends.config import ReferenceBackendConfig
from backends.workers.balancer import RankBalancer
from backends.workers.launch import free_port
from backends.workers.spec import WorkerSpec
from gateway.config import GatewayConfig

from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from ...waiting import wait_ready
from .conftest import STEP, driver_of, open_stream

FACTORY = "backends.reference.backend:build_rank_engine"
LEASE_SECONDS = 2.0


@pytest.fixture(scope="module")
def rank_endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two rank workers, started as a remote host's supervisor would (they know no front end)."""
    folder = tmp_path_factory.mktemp("ranks")
    options = ReferenceBackendConfig(name="dp", timing=STEP).model_dump(mode="json")
    endpoints = [f"ipc://{folder}/rank-{i}" for i in range(2)]
    processes = []
    for rank, endpoint in enumerate(endpoints):
        spec = WorkerSpec(rank, 2, endpoint, FACTORY, options, parent_pid=os.getpid(), lease_seconds=LEASE_SECONDS)
        processes.append(subprocess.Popen([sys.executable, "-m", "backends.workers.worker", spec.to_json()]))
    yield endpoints
    for process in processes:
        process.kill()
        process.wait()


def front_end_backend(endpoints: list[str]) -> dict[str, object]:
    return {"name": "dp", "kind": "reference", "data_parallel_size": 2, "worker_endpoints": endpoints, "timing": STEP}


def start_front_end(endpoints: list[str]) -> RunningGateway:
    config = GatewayConfig(backends=[front_end_backend(endpoints)], models=[{"name": "dp", "backends": ["dp"]}])
    return start_gateway(config, ready_timeout=60)


@pytest.fixture
def front_ends(rank_endpoints: list[str]) -> Iterator[list[RunningGateway]]:
    gateways = [start_front_end(rank_endpoints) for _ in range(2)]
    yield gateways
    for gateway in gateways:
        stop_gateway(gateway)


def seeded_chat(base_url: str, text: str, request_id: str) -> str:
    body = {"model": "dp", "messages": [{"role": "user", "content": text}], "max_tokens": 12, "seed": 7}
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"X-Request-ID": request_id}, timeout=60
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_two_front_ends_share_two_ranks_and_both_get_correct_answers(front_ends: list[RunningGateway]) -> None:
    reference = start_gateway(
        GatewayConfig(
            backends=[{"name": "dp", "kind": "reference", "timing": STEP}], models=[{"name": "dp", "backends": ["dp"]}]
        )
    )
    try:
        texts = [f"Question {i} about rivers?" for i in range(6)]
        expected = [seeded_chat(reference.base_url, text, f"expected-{i}") for i, text in enumerate(texts)]
    finally:
        stop_gateway(reference)
    answers: dict[tuple[int, int], str] = {}
    errors: list[BaseException] = []

    def ask(front: int, i: int) -> None:
        try:
            # The same X-Request-ID on both front ends: their engine request ids collide on the ranks.
            answers[front, i] = seeded_chat(front_ends[front].base_url, texts[i], f"shared-{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(front, i)) for front in range(2) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for front in range(2):
        assert [answers[front, i] for i in range(len(texts))] == expected, f"front end {front}"
        assert all(rank.dispatched > 0 for rank in driver_of(front_ends[front], "dp").ranks), "both ranks served it"


def test_load_reported_by_the_ranks_steers_every_front_end(front_ends: list[RunningGateway]) -> None:
    for busy, other in ((0, 1), (1, 0)):
        busy_driver, other_driver = driver_of(front_ends[busy], "dp"), driver_of(front_ends[other], "dp")
        with httpx.Client(base_url=front_ends[busy].base_url, timeout=60) as http, open_stream(http, "dp", 3000) as s:
            next(s)
            held = next(r.index for r in busy_driver.ranks if r.outstanding == 1)
            # The other front end learns of that request only from the ranks' reports.
            assert wait_until(lambda: other_driver.ranks[held].others.requests == 1, timeout=30)  # noqa: B023
            before = [r.dispatched for r in other_driver.ranks]
            for i in range(4):
                seeded_chat(front_ends[other].base_url, f"Short question {i}?", f"steer-{busy}-{i}")
            after = [r.dispatched for r in other_driver.ranks]
            assert after[held] == before[held], "the front end avoided the rank busy with the other's request"
            assert after[1 - held] == before[1 - held] + 4


def rank_metric(gateway: RunningGateway, name: str) -> list[float]:
    """A per-rank family of this front end's ``/metrics``, rank by rank."""
    return [gateway.metric(name, backend="dp", rank=str(rank)) for rank in range(2)]


def test_every_front_end_shows_the_ranks_own_counters_and_gauges(front_ends: list[RunningGateway]) -> None:
    """Each rank reports its own numbers to every dispatcher: whichever front end a scrape reaches, it shows every
    request the ranks took, counted once, and what they hold right now (not only its own share)."""
    dispatched = "gateway_dp_rank_dispatched_requests_total"
    ranks = [rank for gateway in front_ends for rank in driver_of(gateway, "dp").ranks]
    assert wait_until(lambda: all(r.stats is not None for r in ranks), timeout=30), "both front ends heard each rank"
    assert wait_until(lambda: rank_metric(front_ends[0], dispatched) == rank_metric(front_ends[1], dispatched))
    before = sum(rank_metric(front_ends[0], dispatched))
    for front, count in ((0, 3), (1, 5)):
        for i in range(count):
            seeded_chat(front_ends[front].base_url, f"Counted once {i}?", f"counted-{front}-{i}")
    for gateway in front_ends:
        assert wait_until(lambda: sum(rank_metric(gateway, dispatched)) == before + 8), rank_metric(  # noqa: B023
            gateway, dispatched
        )
    with httpx.Client(base_url=front_ends[0].base_url, timeout=60) as http, open_stream(http, "dp", 3000) as s:
        next(s)
        held = next(r.index for r in driver_of(front_ends[0], "dp").ranks if r.outstanding == 1)
        for gateway in front_ends:
            holding = [1.0 if rank == held else 0.0 for rank in range(2)]
            assert wait_until(lambda: rank_metric(gateway, "gateway_dp_rank_requests") == holding)  # noqa: B023
    for gateway in front_ends:
        assert wait_until(lambda: rank_metric(gateway, "gateway_dp_rank_requests") == [0.0, 0.0])  # noqa: B023


def test_a_prefix_goes_to_the_same_rank_whichever_front_end_it_reaches(front_ends: list[RunningGateway]) -> None:
    """The ranks pass each prompt's prefix hashes on to their other dispatchers: a conversation whose turns reach
    different front ends keeps going to the rank whose cache holds it."""
    rng = np.random.default_rng(23)
    prefixes = [rng.integers(10, 8000, size=640).tolist() for _ in range(4)]

    def complete(front: int, ids: list[int]) -> int:
        """Sends the prompt through one front end; the rank it went to."""
        driver = driver_of(front_ends[front], "dp")
        before = [rank.dispatched for rank in driver.ranks]
        body = {"model": "dp", "prompt": ids, "max_tokens": 2}
        response = httpx.post(f"{front_ends[front].base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        (rank,) = [r.index for r in driver.ranks if r.dispatched != before[r.index]]
        return rank

    first = [complete(0, [*prefix, 1000 + i]) for i, prefix in enumerate(prefixes)]
    assert sorted(first) == [0, 0, 1, 1], "idle ranks take new prefixes in turn"
    balancer = driver_of(front_ends[1], "dp").balancer
    for prefix, rank in zip(prefixes, first, strict=True):
        held = np.asarray([*prefix, 0], dtype=np.int32)
        assert wait_until(lambda: known_holder(balancer, held) == (rank, 640)), "the other front end learns where"  # noqa: B023
    order = [0, 2, 1, 3]  # not the order the first front end saw: its turns would not repeat by chance
    again = [complete(1, [*prefixes[i], 2000 + i]) for i in order]
    assert again == [first[i] for i in order]


def known_holder(balancer: RankBalancer, prompt: np.ndarray) -> tuple[int, int]:
    """The rank a front end's balancer believes holds the longest prefix of ``prompt``, and its length in tokens."""
    return balancer._longest_hit(balancer.prefix_hashes(prompt).tolist())


def others_on_ranks(gateway: RunningGateway) -> int:
    """Requests of other front ends the ranks last reported holding, as this front end sees them."""
    return sum(rank.others.requests for rank in driver_of(gateway, "dp").ranks)


@pytest.mark.parametrize("fate", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_front_end_has_its_requests_aborted_on_the_ranks_while_the_other_serves(
    rank_endpoints: list[str], tmp_path: Path, fate: signal.Signals
) -> None:
    """Killed: the ranks see its connection go. Frozen (SIGSTOP, like a host that stopped answering): it stops
    reading and pinging, and loses its lease; thawed, it learns so, fails what it had and serves again."""
    survivor = start_front_end(rank_endpoints)
    port = free_port("127.0.0.1")
    config = {
        "server": {"http": {"port": port}},
        "backends": [front_end_backend(rank_endpoints)],
        "models": [{"name": "dp", "backends": ["dp"]}],
    }
    path = tmp_path / "front-end.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "front-end.log"
    with log.open("wb") as out:
        victim = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)], stdout=out)
    body = {
        "model": "dp",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 3000,  # 30 s at the least: far longer than the lease
        "ignore_eos": True,
        "stream": True,
    }
    try:
        assert wait_ready(f"{base}/ready", timeout=120)
        assert wait_until(lambda: others_on_ranks(survivor) == 0, timeout=30)
        with httpx.Client(base_url=base, timeout=60) as http, contextlib.ExitStack() as streams:
            readers = []
            for _ in range(2):
                response = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
                assert response.status_code == 200
                readers.append(response.iter_lines())  # kept: a reader dropped would close its stream
                next(readers[-1])
            assert wait_until(lambda: others_on_ranks(survivor) == 2, timeout=30), "the ranks hold both"
            victim.send_signal(fate)
            # The ranks drop the lost front end and abort its requests; the survivor keeps serving.
            assert seeded_chat(survivor.base_url, "Still there?", "after-loss-0")
            assert wait_until(lambda: others_on_ranks(survivor) == 0, timeout=30), "its requests run on the ranks"
            assert seeded_chat(survivor.base_url, "Still there?", "after-loss-1")
            assert all(rank.state == "up" for rank in driver_of(survivor, "dp").ranks)
            if fate == signal.SIGKILL:
                victim.wait()
                streams.pop_all()  # their connections died with the process
                return
            victim.send_signal(signal.SIGCONT)
            for reader in readers:  # thawed: its streams end (with an error frame), they do not hang
                events = [line for line in reader if line]
                assert events[-1] == "data: [DONE]"
                assert orjson.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"

            def details() -> list[str]:  # the client's message is generic; the log line has the detail
                lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
                return [line["error_detail"] for line in lines if "error_detail" in line]

            assert wait_until(lambda: len(details()) == 2, timeout=30)
            assert all("dropped this dispatcher" in detail for detail in details()), details()
        assert wait_ready(f"{base}/ready", timeout=60)
        assert seeded_chat(base, "Back again?", "thawed")
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        stop_gateway(survivor)

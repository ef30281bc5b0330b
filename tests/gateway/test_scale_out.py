"""Several gateways, one budget: per-key limits shared through a real Valkey server, and front-end processes.

The store is a real ``valkey-server`` (``tests/valkey.py``), killed and started again where the test needs it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.config import GatewayConfig

from ..budget_client import (
    FrozenClock,
    charge_of_next_request,
    charged,
    post,
    prompt_estimate,
    prompt_tokens,
    remaining_tokens,
    stream_and_hang_up,
)
from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until
from ..processes import free_port, front_ends, is_ready, ranks
from ..valkey import ValkeyServer

KEY = "sk-shared-0123456789"
ADMIN_KEY = "sk-admin-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path)
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def _config(store_url: str, timing: dict[str, float] | None = None, **key_limits: int) -> GatewayConfig:
    return GatewayConfig(
        server={
            "auth": {"api_keys": [{"key": KEY, "name": "team", **key_limits}], "admin_api_key": ADMIN_KEY},
            "stores": {"state_store": store_url},
        },
        backends=[{"name": "reference", "kind": "reference", "timing": timing or {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )


def _post(gateway: RunningGateway, body: dict[str, object] = CHAT) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


@pytest.fixture
def two_gateways(valkey: ValkeyServer, request: pytest.FixtureRequest) -> Iterator[list[RunningGateway]]:
    limits = request.param
    gateways = [start_gateway(_config(valkey.url, **limits)) for _ in range(2)]
    yield gateways
    for gateway in gateways:
        stop_gateway(gateway)


@pytest.mark.parametrize("two_gateways", [{"requests_per_minute": 5}], indirect=True)
def test_two_gateways_admit_exactly_one_requests_budget_between_them(two_gateways: list[RunningGateway]) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: _post(two_gateways[i % 2]).status_code, range(16)))
    elapsed = time.monotonic() - started
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    # The bucket refills 5 requests a minute: one more for every full 12 s the burst took (none, normally).
    assert 5 <= admitted <= 5 + int(elapsed // 12), statuses


@pytest.mark.parametrize("two_gateways", [{"tokens_per_minute": 60}], indirect=True)
def test_tokens_are_reserved_at_admission_so_a_concurrent_request_cannot_pass_a_spent_budget(
    two_gateways: list[RunningGateway],
) -> None:
    first, second = two_gateways
    body = {**CHAT, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        headers = {"Authorization": f"Bearer {KEY}"}
        with client.stream("POST", f"{first.base_url}/v1/chat/completions", json=body, headers=headers) as stream:
            assert stream.status_code == 200
            assert stream.headers["x-ratelimit-remaining-tokens"] == "0"
            lines = stream.iter_lines()
            next(lines)  # the first request is generating, its 60 tokens not yet used
            refused = _post(second, {**CHAT, "max_tokens": 5})
            assert refused.status_code == 429, "the other gateway sees the reservation"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(refused.headers["retry-after"]) >= 1


def test_two_gateways_on_one_valkey_charge_a_hang_up_and_release_a_routing_error(valkey: ValkeyServer) -> None:
    """The rules of the budgets hold in the shared store: a client that hangs up on one gateway pays for what it
    read, a request that fails at routing on the other gives its reservation back, and both see the one bucket."""
    tpm, step = 100_000, 4
    config = _config(valkey.url, {"decode_seconds_per_step": 0.05, "tokens_per_step": step}, tokens_per_minute=tpm)
    clock = FrozenClock()  # one clock for both, as the store's own clock would be
    first, second = (start_gateway(config, budget_clock=clock) for _ in range(2))
    try:
        body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "logprobs": True}
        read = stream_and_hang_up(first.base_url, KEY, body, tokens=60)
        charge = charge_of_next_request(first, "team", 0)
        assert read <= charge - prompt_tokens(first.base_url, KEY, body) <= read + step
        for _ in range(4):
            assert post(second.base_url, KEY, {**body, "model": "no-such-model", "max_tokens": 400}).status_code == 404
        probe = {**CHAT, "max_tokens": 2}
        for gateway in (second, first):
            spent = charged(first, "team") + charged(second, "team")
            response = post(gateway.base_url, KEY, probe)
            assert remaining_tokens(response) == tpm - spent - (prompt_estimate(probe) + 2)
            charge_of_next_request(gateway, "team", charged(gateway, "team") - 1)  # its settlement is done
        assert _metric(first, "gateway_state_store_failures_total") == 0, "the store, not local budgets"
    finally:
        stop_gateway(first)
        stop_gateway(second)


def test_every_script_keeps_to_one_slot_of_a_cluster(tmp_path: Path) -> None:
    """A cluster-mode Valkey refuses a script over keys of several slots (CROSSSLOT), as Redis Cluster and
    cluster-mode managed services do: budgets and stored responses work there, with no store failure."""
    cluster = ValkeyServer(tmp_path, cluster=True)
    cluster.start()
    config = _config(cluster.url, requests_per_minute=100, tokens_per_minute=100_000)
    config.server.stores.responses_store = cluster.url
    running = start_gateway(config, budget_clock=FrozenClock())
    try:
        assert post(running.base_url, KEY, CHAT).status_code == 200
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=KEY, max_retries=0)
        created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert client.responses.retrieve(created.id).id == created.id
        client.responses.delete(created.id)
        assert _metric(running, "gateway_state_store_failures_total") == 0
        assert _metric(running, "gateway_response_store_write_failures_total") == 0
        raw = cluster.client()
        try:
            assert raw.dbsize() > 0, "the gateway wrote to the cluster"
        finally:
            raw.close()
    finally:
        stop_gateway(running)
        cluster.kill()


def _metric(gateway: RunningGateway, name: str) -> float:
    for line in httpx.get(f"{gateway.base_url}/metrics", headers=ADMIN).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_store_down_keeps_requests_flowing_on_local_budgets_and_recovers_by_itself(valkey: ValkeyServer) -> None:
    gateway = start_gateway(_config(valkey.url, requests_per_minute=1000))
    try:
        assert _post(gateway).status_code == 200
        assert _metric(gateway, "gateway_state_store_up") == 1.0
        valkey.kill()
        assert _post(gateway).status_code == 200, "a store failure never fails a request"
        ready = httpx.get(f"{gateway.base_url}/ready")
        assert ready.status_code == 200
        # Client keys and no admin key: the store's URL and error are nobody's to read in /ready (the log has them).
        assert ready.json()["state_store"] == {"up": False}
        assert _metric(gateway, "gateway_state_store_up") == 0.0
        assert _metric(gateway, "gateway_state_store_failures_total") >= 1
        valkey.start()
        assert wait_until(lambda: _metric(gateway, "gateway_state_store_up") == 1.0, timeout=30)
        assert _post(gateway).status_code == 200
        assert httpx.get(f"{gateway.base_url}/ready").json()["state_store"]["up"] is True
    finally:
        stop_gateway(gateway)


@contextlib.contextmanager
def _serve(tmp_path: Path, config: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``deepinfer-gateway serve`` as an operator starts it, with ``config`` on a free port: the supervisor process
    and its base URL. Killed at the end if still up (its front ends follow it); its output goes to a log file."""
    port = free_port()
    path = tmp_path / "gateway.yaml"
    server = {**config["server"], "http": {**config["server"].get("http", {}), "port": port}}
    path.write_text(yaml.safe_dump({**config, "server": server}))
    command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)]
    with (tmp_path / "supervisor.log").open("wb") as log:
        supervisor = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield supervisor, f"http://127.0.0.1:{port}"
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()


def test_front_end_processes_share_one_port_one_budget_and_come_back_when_killed(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    config = {
        "server": {
            "auth": {"api_keys": [{"key": KEY, "name": "team", "requests_per_minute": 6}], "admin_api_key": ADMIN_KEY},
            "stores": {"state_store": valkey.url},
            "runtime": {"workers": 2},
        },
        "backends": [{"name": "reference", "kind": "reference"}],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }
    with _serve(tmp_path, config) as (supervisor, base):
        assert wait_until(lambda: len(front_ends(supervisor.pid)) == 2, timeout=60)
        assert wait_until(lambda: is_ready(base), timeout=180)
        workers = front_ends(supervisor.pid)

        started = time.monotonic()
        with httpx.Client(base_url=base, timeout=60) as client:
            # new connections, so the kernel spreads them over both processes
            statuses = [
                httpx.post(
                    f"{base}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}
                ).status_code
                for _ in range(14)
            ]
            elapsed = time.monotonic() - started
            assert 6 <= statuses.count(200) <= 6 + int(elapsed // 10), statuses
            # whichever process answers the scrape, the request counter sums both
            for _ in range(4):
                assert _served(httpx.get(f"{base}/metrics", headers=ADMIN).text) == statuses.count(200)

            victim = sorted(workers)[0]
            os.kill(victim, signal.SIGKILL)
            assert wait_until(lambda: victim not in front_ends(supervisor.pid), timeout=30)
            assert client.get("/health").status_code == 200, "the other process keeps serving"
            assert wait_until(
                lambda: len(front_ends(supervisor.pid)) == 2 and victim not in front_ends(supervisor.pid),
                timeout=60,
            ), "the supervisor starts a new front end"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=180) == 0  # a safety net: a process just restarted may still be starting


def test_front_end_processes_exit_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    probe_port = free_port()
    config = {
        "server": {"http": {"probe_port": probe_port}, "runtime": {"workers": 2}},
        "backends": [{"name": "reference", "kind": "reference"}],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }
    with _serve(tmp_path, config) as (supervisor, _):
        assert wait_until(lambda: len(front_ends(supervisor.pid)) == 2, timeout=60)
        assert wait_until(lambda: is_ready(f"http://127.0.0.1:{probe_port}"), timeout=180), (
            "the front ends share the supervisor's probe listener too"
        )
        serving = front_ends(supervisor.pid)
        supervisor.kill()  # SIGKILL: it cannot pass SIGTERM on
        supervisor.wait()
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in serving), timeout=60), (
            "no orphan keeps serving the port"
        )


def test_front_ends_share_the_rank_workers_the_supervisor_hosts_and_one_killed_leaves_them_serving(
    tmp_path: Path,
) -> None:
    config = {
        "server": {"runtime": {"workers": 2}},
        "backends": [
            {
                "name": "reference",
                "kind": "reference",
                "data_parallel_size": 2,
                "timing": {"decode_seconds_per_step": 0.01},
            }
        ],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }
    seeded = {**CHAT, "max_tokens": 8, "seed": 11}

    def answers(base: str, count: int) -> list[str]:
        out = []
        for _ in range(count):  # new connections, so the kernel spreads them over both processes
            response = httpx.post(f"{base}/v1/chat/completions", json=seeded, timeout=60)
            assert response.status_code == 200, response.text
            out.append(response.json()["choices"][0]["message"]["content"])
        return out

    with _serve(tmp_path, config) as (supervisor, base):
        assert wait_until(lambda: len(front_ends(supervisor.pid)) == 2, timeout=60)
        assert wait_until(lambda: is_ready(base), timeout=180)
        hosted = ranks(supervisor.pid)
        assert len(hosted) == 2, "one set of ranks for both front ends, started by the supervisor"
        first = answers(base, 8)
        assert len(set(first)) == 1, "every front end, every rank: the same seeded answer"

        victim = sorted(front_ends(supervisor.pid))[0]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: victim not in front_ends(supervisor.pid), timeout=30)
        assert answers(base, 4) == first[:4], "the other front end keeps serving from the same ranks"
        assert wait_until(
            lambda: len(front_ends(supervisor.pid)) == 2 and victim not in front_ends(supervisor.pid),
            timeout=60,
        ), "the supervisor starts a new front end"
        assert wait_until(lambda: is_ready(base), timeout=60)
        assert answers(base, 6) == first[:6]
        assert ranks(supervisor.pid) == hosted, "the ranks were neither restarted nor duplicated"

        lost = sorted(hosted)[0]
        os.kill(lost, signal.SIGKILL)  # a rank dies: the supervisor starts it again, every front end reconnects
        assert wait_until(lambda: len(ranks(supervisor.pid) - hosted) == 1, timeout=60)
        assert wait_until(lambda: _all_answer(base, seeded, first[0], 6), timeout=60)

        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=180) == 0
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in hosted), timeout=30)


def _all_answer(base: str, body: dict[str, object], expected: str, count: int) -> bool:
    """``count`` requests in a row, on new connections, all answered with ``expected``."""
    for _ in range(count):
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        if response.status_code != 200 or response.json()["choices"][0]["message"]["content"] != expected:
            return False
    return True


def _served(exposition: str) -> float:
    """Chat requests served with status 200 (probes and scrapes are counted too, with an empty model)."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("gateway_requests_total{") and 'status="200"' in line and f'model="{MODEL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total

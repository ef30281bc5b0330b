"""``deepinfer-gateway ranks`` for a reference backend: one node runs every rank its file lists, a gateway elsewhere
reaches them over TCP, SIGTERM closes them. (The deepinfer kind over two nodes: tests/backends/deepinfer.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import yaml
import zmq

from backends.config import ReferenceBackendConfig
from backends.workers.launch import free_port
from backends.workers.spec import WorkerSpec

from ...conftest import stop_gateway, wait_until
from .conftest import driver_of, start_data_parallel_gateway, worker_pids


def test_a_node_runs_the_listed_ranks_for_a_gateway_and_closes_them_on_sigterm(tmp_path: Path) -> None:
    endpoints = [f"tcp://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    backend = {"name": "remote", "kind": "reference", "data_parallel_size": 2, "worker_endpoints": endpoints}
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backends": [backend], "models": [{"name": "remote", "backends": ["remote"]}]}))
    command = [sys.executable, "-m", "gateway.cli", "ranks", "-c", str(config), "--backend", "remote"]
    log = tmp_path / "node.log"
    node = subprocess.Popen([*command, "--host", "127.0.0.1"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    gateway = None
    try:
        assert wait_until(lambda: len(worker_pids(node.pid)) == 2, timeout=30)
        gateway = start_data_parallel_gateway([backend])
        driver = driver_of(gateway, "remote")
        assert {rank.pid for rank in driver.ranks} == worker_pids(node.pid), "the gateway serves from the node's ranks"
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            reply = client.chat.completions.create(
                model="remote", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content
        assert [rank.dispatched for rank in driver.ranks] == [1, 1]
        ranks = worker_pids(node.pid)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "the ranks closed with the node"
        assert "did not stop in time" not in log.read_text(), "each rank closed its engine, none was killed"
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_gateway_waiting_for_a_rank_greets_its_replacement() -> None:
    """A remote rank that took the gateway's hello and died while loading its engine, replaced behind the same
    endpoint: the gateway, still waiting, says hello again and serves from the replacement (not after the start
    deadline of 30 minutes)."""
    endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    backend = {"name": "remote", "kind": "reference", "worker_endpoints": [endpoint]}
    options = ReferenceBackendConfig.model_validate(backend).model_dump(mode="json")
    context = zmq.Context()
    loading = context.socket(zmq.ROUTER)  # the first incarnation: bound, still loading, reading nothing
    loading.bind(endpoint)
    replacement: list[subprocess.Popen[bytes]] = []

    def die_and_be_replaced() -> None:
        assert loading.poll(30_000), "the gateway's hello reached the loading rank"
        loading.close(linger=0)  # it dies with the hello unanswered
        spec = WorkerSpec(0, 1, endpoint, "backends.reference.backend:build_rank_engine", options)
        replacement.append(subprocess.Popen([sys.executable, "-m", "backends.workers.worker", spec.to_json()]))

    swap = threading.Thread(target=die_and_be_replaced)
    swap.start()
    gateway = None
    try:
        gateway = start_data_parallel_gateway([backend])  # raises unless ready within 60 s
        swap.join()
        assert driver_of(gateway, "remote").ranks[0].pid == replacement[0].pid
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="remote", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
    finally:
        swap.join()
        if gateway is not None:
            stop_gateway(gateway)
        for process in replacement:
            process.kill()
            process.wait()
        context.term()

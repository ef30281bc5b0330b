"""``deepinfer-gateway ranks`` for a reference backend: one node runs every rank its file lists, a gateway elsewhere
reaches them over TCP, SIGTERM closes them. (The deepinfer kind over two nodes: tests/backends/deepinfer.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import yaml

from backends.workers.driver import free_port

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

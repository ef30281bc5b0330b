"""DeepInfer DP ranks on other hosts: each node runs its share with ``deepinfer-gateway ranks``, the gateway lists them
all in ``worker_endpoints`` and reaches them over TCP, and the ranks meet at one torch.distributed rendezvous.

Two "nodes" on loopback, one rank each, both with their own device 0 as two hosts would have; the ranks import the
TEST DOUBLEs of ``deepinfer`` and ``torch.distributed`` (``PYTHONPATH``), whose collectives fail every rank of a
group that does not step together. Everything runs through the CLI, as ``deploy/kubernetes/deepinfer-multinode``
runs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from backends.deepinfer.environment import free_rendezvous_port

from ...conftest import wait_until
from ...processes import children, free_port, is_ready
from .test_data_parallel import ENGINE_ENV, MAX_MODEL_LEN
from .test_front_ends import answer, double_environment


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


class Cluster:
    """The gateway and its two rank nodes, each a CLI process; logs in ``folder``."""

    def __init__(self, folder: Path, model_dir: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        backend: dict[str, Any] = {
            "name": "di",
            "kind": "deepinfer",
            "model": str(model_dir),
            "max_model_len": MAX_MODEL_LEN,
            "data_parallel_size": 2,
            "master_port": free_rendezvous_port(),
            "worker_endpoints": self.endpoints,
            "env": ENGINE_ENV,
        }
        config = {
            "server": {"http": {"port": self.port}},
            "backends": [backend],
            "models": [{"name": "di", "backends": ["di"]}],
        }
        self.config = folder / "gateway.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.environment = {**double_environment(), "DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT": "5"}
        self.environment.pop("CUDA_VISIBLE_DEVICES", None)
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None

    def _run(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.folder / f"{name}.log").open("ab")
        command = [sys.executable, "-m", "gateway.cli", *args, "-c", str(self.config)]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.environment)

    def start_nodes(self) -> None:
        self.nodes = [
            self._run(f"node-{k}", "ranks", "--backend", "di", "--nodes", "2", "--node", str(k), "--host", "127.0.0.1")
            for k in range(2)
        ]

    def start_gateway(self) -> None:
        self.gateway = self._run("gateway", "serve")

    def ranks_of(self, node: int) -> list[int]:
        return children(self.nodes[node].pid)

    def close(self) -> None:
        for process in [*self.nodes, *([self.gateway] if self.gateway else [])]:
            if process.poll() is None:
                process.kill()  # a node's ranks die with it (PR_SET_PDEATHSIG)
                process.wait()


@pytest.fixture
def cluster(tmp_path: Path, model_dir: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path, model_dir)
    try:
        yield running
    finally:
        running.close()


def test_a_gateway_serves_from_deepinfer_ranks_that_two_nodes_run(cluster: Cluster) -> None:
    cluster.start_nodes()
    cluster.start_gateway()
    assert wait_until(lambda: is_ready(cluster.base), timeout=60), "the gateway reaches both nodes' ranks"
    ready = httpx.get(f"{cluster.base}/ready").json()["backends"]["di"]
    assert ready["reason"].startswith("2/2 ranks up")
    ranks = [cluster.ranks_of(0), cluster.ranks_of(1)]
    assert [len(r) for r in ranks] == [1, 1], "each node runs its share: one rank"
    environs = [environ_of(r[0]) for r in ranks]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environs] == ["0", "0"], "each node's rank drives its own device"
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in environs}) == 1, "one rendezvous for the group"
    for _ in range(4):
        assert answer(cluster.base, "di")
    metrics = httpx.get(f"{cluster.base}/metrics").text
    dispatched = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('gateway_dp_rank_dispatched_requests_total{backend="di"')
    ]
    assert len(dispatched) == 2 and min(dispatched) >= 1, "both nodes' ranks served chats"

    # A rank dies: its node exits, and the other node's rank fails with the broken group; restarted whole (as a
    # LeaderWorkerSet recreates its group), the group meets again and the gateway serves from it without a restart.
    os.kill(ranks[1][0], signal.SIGKILL)
    assert cluster.nodes[1].wait(timeout=60) == 1
    assert cluster.nodes[0].wait(timeout=60) == 1, "the rank left alone in its group fails, and its node exits"
    assert wait_until(lambda: not is_ready(cluster.base), timeout=30)
    cluster.start_nodes()
    assert wait_until(lambda: is_ready(cluster.base), timeout=60)
    for _ in range(2):
        assert answer(cluster.base, "di")

    # SIGTERM to one node: its ranks stop, the group agrees to stop with them, and both nodes exit cleanly.
    cluster.nodes[0].send_signal(signal.SIGTERM)
    assert [node.wait(timeout=60) for node in cluster.nodes] == [0, 0]


def test_the_ranks_command_refuses_a_layout_it_cannot_run(cluster: Cluster) -> None:
    """Mistakes in the file or the flags end the command at once with status 2 and the reason, before any rank."""
    original = yaml.safe_load(cluster.config.read_text())
    layouts: list[tuple[dict[str, Any], list[str], str]] = [
        ({}, ["--backend", "nope"], "no backend 'nope'"),
        ({"worker_endpoints": [], "data_parallel_size": 1}, ["--backend", "di"], "lists no worker_endpoints"),
        ({"master_port": None}, ["--backend", "di", "--nodes", "2", "--node", "1"], "set master_port"),
        ({}, ["--backend", "di", "--nodes", "3", "--node", "0"], "cannot be shared equally by 3 nodes"),
        ({}, ["--backend", "di", "--nodes", "2", "--node", "2"], "node index must be in 0..1"),
    ]
    for change, flags, reason in layouts:
        backend = {**original["backends"][0], **change}
        cluster.config.write_text(yaml.safe_dump({**original, "backends": [backend]}))
        command = [sys.executable, "-m", "gateway.cli", "ranks", "-c", str(cluster.config), *flags]
        result = subprocess.run(command, capture_output=True, text=True, env=cluster.environment, timeout=60)
        assert (result.returncode, reason in result.stderr) == (2, True), (flags, result.stderr)

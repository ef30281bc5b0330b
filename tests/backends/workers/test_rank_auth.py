"""The rank plane holds against a peer that tries: over TCP a rank takes commands only from dispatchers whose CURVE
key it admits (``rank_keys``), and a rank that would be reachable from other hosts without keys does not start.

Keys come from ``deepinfer-gateway rank-keys`` as an operator makes them. The rank is a real worker process; the
intruders are raw ZeroMQ peers (``peer.RankPeer``) speaking the real protocol, without a key or with one the rank
does not admit; what they achieved is read from the rank's own counters, through the gateway that holds the key.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml
import zmq
import zmq.auth

from backends.workers import messages as m
from backends.workers.keys import RANK_KEY, SECRET_SUFFIX
from backends.workers.launch import free_port

from ...conftest import stop_gateway
from .conftest import driver_of, start_data_parallel_gateway
from .peer import RankPeer, add, rank_process

SILENCE_MS = 2000
"""How long an intruder listens for an answer. Without authentication the rank answers within milliseconds."""


@pytest.fixture(scope="module")
def rank_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rank-keys")
    made = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "rank-keys", str(directory)], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    return directory


def intrude(peer: RankPeer) -> bool:
    """Says hello, submits a request, asks the rank to stop: True if the rank answered any of it. (Sent without
    blocking: a DEALER whose handshakes fail has, between its attempts, no connection to queue a message on.)"""
    for message in ([m.RESET], [m.BATCH, [add("stolen", 200)], [], 0], [m.STOP]):
        with contextlib.suppress(zmq.Again):
            peer.socket.send(m.pack(message), zmq.NOBLOCK)
    return bool(peer.socket.poll(SILENCE_MS))


def test_peers_without_an_admitted_key_can_neither_submit_to_a_rank_nor_stop_it(rank_keys: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    backend = {"name": "guarded", "kind": "reference", "worker_endpoints": [endpoint], "rank_keys": str(rank_keys)}
    context = zmq.Context()
    rank_public, _ = zmq.auth.load_certificate(rank_keys / f"{RANK_KEY}{SECRET_SUFFIX}")
    stranger_public, stranger_secret = zmq.curve_keypair()
    with rank_process(endpoint, backend, keys=str(rank_keys)) as rank:
        try:
            no_key = RankPeer(context, endpoint, b"no-key")
            unknown_key = RankPeer(
                context,
                endpoint,
                b"unknown-key",
                curve={
                    zmq.CURVE_SERVERKEY: rank_public,
                    zmq.CURVE_PUBLICKEY: stranger_public,
                    zmq.CURVE_SECRETKEY: stranger_secret,
                },
            )
            assert not intrude(no_key), "a peer without a key was answered"
            assert not intrude(unknown_key), "a peer whose key the rank does not admit was answered"

            gateway = start_data_parallel_gateway([backend])  # holds gateway.key_secret: admitted
            try:
                client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
                reply = client.chat.completions.create(
                    model="guarded",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    extra_body={"ignore_eos": True},  # exactly 4 tokens: an early EOS made the count 3
                )
                assert reply.choices[0].message.content
                (state,) = driver_of(gateway, "guarded").ranks
                assert state.pid == rank.pid and rank.poll() is None, "the STOPs never reached it: still up"
                assert state.stats is not None and state.stats.dispatched == 1, "it ran the gateway's request only"
                assert state.stats.tokens == 4
            finally:
                stop_gateway(gateway)
        finally:
            context.destroy(linger=0)


def test_a_rank_that_others_could_reach_refuses_to_start_without_keys(tmp_path: Path, rank_keys: Path) -> None:
    exposed = f"tcp://0.0.0.0:{free_port('127.0.0.1')}"
    with rank_process(exposed, {}) as rank:
        assert rank.wait(timeout=60) == 2, "a worker bound on every interface without keys"
    endpoints = [f"tcp://127.0.0.1:{free_port('127.0.0.1')}"]
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backends": [{"name": "remote", "kind": "reference", "worker_endpoints": endpoints}],
                "models": [{"name": "remote", "backends": ["remote"]}],
            }
        )
    )
    command = [sys.executable, "-m", "gateway.cli", "ranks", "-c", str(config), "--backend", "remote"]
    refused = subprocess.run([*command, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "rank_keys" in refused.stderr and "127.0.0.1" in refused.stderr

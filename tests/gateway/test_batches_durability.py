"""Batches outlive their process: a gateway killed with SIGKILL mid-batch and started again (or a second replica on
the same store) finishes the batch, with every ``custom_id`` in the files exactly once."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import yaml

from ..conftest import MODEL, wait_until
from ..processes import free_port, is_ready
from ..valkey import ValkeyServer

LINES = 12
STORE = "batches.sqlite3"


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The ``server`` settings of a batch store every process of a test shares: an SQLite file, or a real Valkey
    (the state store) with a files folder. A gateway killed and started again is shown on the default store
    (SQLite); replicas taking over from each other on the store meant for replicas (Valkey): each test is a few
    process starts, so each runs once."""
    if request.param == "sqlite":
        yield {"batches": {"store": f"sqlite://{tmp_path / STORE}"}}
        return
    valkey = ValkeyServer(tmp_path)
    valkey.start()
    try:
        yield {"state_store": valkey.url, "batches": {"store": "state_store", "files_dir": str(tmp_path / "files")}}
    finally:
        valkey.kill()


@contextlib.contextmanager
def _gateway(tmp_path: Path, name: str, store: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``deepinfer-gateway serve`` as an operator starts it, on a free port, its batches in ``store``."""
    port = free_port()
    config = {
        "server": {
            **store,
            "port": port,
            "batches": {**store["batches"], "concurrency_per_batch": 2, "lease_seconds": 1.0, "poll_seconds": 0.2},
        },
        "backends": [{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.002}}],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    with (tmp_path / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)], stdout=log, stderr=subprocess.STDOUT
        )
        base = f"http://127.0.0.1:{port}"
        try:
            assert wait_until(lambda: is_ready(base), timeout=120), (tmp_path / f"{name}.log").read_text()[-2000:]
            yield process, base
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _requests() -> bytes:
    lines: list[dict[str, Any]] = [
        {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 150, "ignore_eos": True},
        }
        for i in range(LINES)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def _custom_ids(client: openai.OpenAI, batch_id: str) -> list[str]:
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed", batch
    assert batch.error_file_id is None
    assert batch.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert {line["response"]["status_code"] for line in output} == {200}
    return [line["custom_id"] for line in output]


def _done(client: openai.OpenAI, batch_id: str) -> bool:
    return client.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled", "expired")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_gateway_killed_mid_batch_resumes_it_when_started_again_each_custom_id_once(
    tmp_path: Path, store: dict[str, Any]
) -> None:
    with _gateway(tmp_path, "first", store) as (process, base):
        client = _client(base)
        uploaded = client.files.create(file=("requests.jsonl", _requests()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert wait_until(lambda: _completed(client, batch.id) >= 2, timeout=60)
        process.kill()  # SIGKILL: no shutdown, two requests in flight, the lease still held
    with _gateway(tmp_path, "second", store) as (_, base):
        client = _client(base)
        assert client.batches.retrieve(batch.id).request_counts.completed < LINES  # type: ignore[union-attr]
        assert wait_until(lambda: _done(client, batch.id), timeout=120)
        assert sorted(_custom_ids(client, batch.id)) == sorted(f"request-{i}" for i in range(LINES))


@pytest.mark.parametrize("store", ["valkey"], indirect=True)
def test_a_second_replica_takes_over_the_batch_of_one_that_died(tmp_path: Path, store: dict[str, Any]) -> None:
    with _gateway(tmp_path, "first", store) as first, _gateway(tmp_path, "second", store) as second:
        client = _client(first[1])
        uploaded = client.files.create(file=("requests.jsonl", _requests()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert wait_until(lambda: _completed(client, batch.id) >= 2, timeout=60)
        holder = _holder_pid(tmp_path, store, batch.id)
        (dead, _), (_, survivor) = (first, second) if holder == first[0].pid else (second, first)
        assert holder == dead.pid
        dead.kill()
        client = _client(survivor)
        assert client.batches.retrieve(batch.id).request_counts.completed < LINES  # type: ignore[union-attr]
        assert wait_until(lambda: _done(client, batch.id), timeout=120)
        assert sorted(_custom_ids(client, batch.id)) == sorted(f"request-{i}" for i in range(LINES))
        assert _holder_pid(tmp_path, store, batch.id) is None  # ended: nobody holds it


def _holder_pid(tmp_path: Path, store: dict[str, Any], batch_id: str) -> int | None:
    """The process id of whoever holds the batch's lease, as the store says (holders are host:pid:nonce)."""
    if "state_store" in store:
        client = redis.Redis.from_url(store["state_store"])
        try:
            holder = (client.hget(f"{{batches}}:batch:{batch_id}", "holder") or b"").decode()
        finally:
            client.close()
    else:
        with contextlib.closing(sqlite3.connect(tmp_path / STORE)) as db:
            (holder,) = db.execute("SELECT holder FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return int(holder.split(":")[1]) if holder else None

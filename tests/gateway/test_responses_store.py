"""Stored responses: an SQLite file that outlives the gateway, memory that does not, expiry, read-your-writes."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import structlog
from pydantic import ValidationError

from gateway.config import GatewayConfig
from gateway.response_store import (
    MemoryResponseStore,
    ResponseStore,
    SQLiteResponseStore,
    StoredResponse,
    StoredResponses,
    open_response_store,
)

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway
from .test_scale_out import ValkeyServer


def _gateway(store: str) -> RunningGateway:
    return start_gateway(
        GatewayConfig(
            server={"responses_store": store},
            backends=[{"name": "reference", "kind": "reference"}],
            models=[{"name": MODEL, "backends": ["reference"]}],
        )
    )


def _client(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _record(response_id: str, created_at: float, previous: str | None = None) -> StoredResponse:
    body = {"id": response_id, "object": "response", "output": []}
    return StoredResponse(response_id, created_at, body, [{"id": "msg_1", "type": "message"}], previous)


def test_an_sqlite_store_keeps_responses_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.sqlite3"
    first = _gateway(f"sqlite://{path}")
    try:
        assert not path.exists(), "the file is created when the first response is stored, not before"
        created = _client(first).responses.create(model=MODEL, input="Tell me about the module.", max_output_tokens=8)
    finally:
        stop_gateway(first)
    assert path.exists()
    second = _gateway(f"sqlite://{path}")
    try:
        client = _client(second)
        assert client.responses.retrieve(created.id).output_text == created.output_text
        follow = client.responses.create(
            model=MODEL, input="More.", previous_response_id=created.id, max_output_tokens=4
        )
        assert follow.previous_response_id == created.id
    finally:
        stop_gateway(second)


def test_a_memory_store_forgets_at_restart(tmp_path: Path) -> None:
    first = _gateway("memory")
    try:
        client = _client(first)
        created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert client.responses.retrieve(created.id).id == created.id
    finally:
        stop_gateway(first)
    second = _gateway("memory")
    try:
        with pytest.raises(openai.NotFoundError):
            _client(second).responses.retrieve(created.id)
    finally:
        stop_gateway(second)


@pytest.fixture(params=["memory", "sqlite"])
def clocked_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ResponseStore, list[float]]:
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    if request.param == "memory":
        return MemoryResponseStore(max_age=60, clock=clock), now
    return SQLiteResponseStore(tmp_path / "r.sqlite3", max_age=60, clock=clock), now


async def test_stores_drop_responses_older_than_max_age(clocked_store: tuple[ResponseStore, list[float]]) -> None:
    store, now = clocked_store
    try:
        await store.put(_record("resp_old", created_at=now[0]))
        now[0] += 30
        await store.put(_record("resp_new", created_at=now[0], previous="resp_old"))
        got = await store.get("resp_new")
        assert got is not None and got.previous_response_id == "resp_old" and got.input_items[0]["id"] == "msg_1"
        assert (await store.get("resp_old")) is not None
        now[0] += 31  # resp_old is 61 s old, resp_new 31 s
        assert (await store.get("resp_old")) is None
        assert (await store.get("resp_new")) is not None
        assert await store.delete("resp_new")
        assert not await store.delete("resp_new")
        assert (await store.get("resp_new")) is None
    finally:
        await store.close()


async def test_a_memory_store_keeps_the_newest_records_only() -> None:
    store = MemoryResponseStore(max_records=2)
    for i in range(3):
        await store.put(_record(f"resp_{i}", created_at=float(i)))
    assert [await store.get(f"resp_{i}") is not None for i in range(3)] == [False, True, True]


async def test_a_response_is_readable_as_soon_as_its_write_is_started() -> None:
    stored = StoredResponses(MemoryResponseStore())
    stored.save(_record("resp_1", created_at=0.0))
    stored.save(_record("resp_2", created_at=1.0, previous="resp_1"))
    chain = await stored.chain("resp_2", max_records=10)
    assert chain is not None and [r.id for r in chain] == ["resp_1", "resp_2"]
    stored.save(_record("resp_3", created_at=2.0, previous="resp_gone"))
    assert await stored.chain("resp_3", max_records=10) is None
    await stored.aclose()


def test_store_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_GATEWAY_CACHE", str(tmp_path))
    default = open_response_store("sqlite", max_age=None)
    assert isinstance(default, SQLiteResponseStore) and default.path == tmp_path / "responses.sqlite3"
    assert isinstance(open_response_store("memory", max_age=None), MemoryResponseStore)
    explicit = open_response_store(f"sqlite://{tmp_path}/x.db", max_age=None)
    assert isinstance(explicit, SQLiteResponseStore) and explicit.path == tmp_path / "x.db"
    with pytest.raises(ValidationError, match="responses_store"):
        GatewayConfig(server={"responses_store": "redis://localhost"})


def test_a_store_that_cannot_write_is_counted_and_answers_500s_never_crashes(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    running = _gateway(f"sqlite://{blocker}/responses.sqlite3")
    try:
        client = _client(running)
        created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert created.output_text is not None
        with structlog.testing.capture_logs() as logs, pytest.raises(openai.InternalServerError) as caught:
            client.responses.retrieve(created.id)
        request_id = caught.value.response.headers["x-request-id"]
        message = caught.value.response.json()["error"]["message"]
        assert message == f"The server had an error processing your request. (request id {request_id})"
        assert "sqlite" not in caught.value.response.text.lower() and str(blocker) not in caught.value.response.text
        (line,) = [line for line in logs if line.get("event") == "request" and line["request_id"] == request_id]
        assert "response store failed" in line["error_detail"], "the detail goes to the log"
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert "gateway_response_store_write_failures_total 1.0" in metrics
        assert "gateway_responses_stored_total 0.0" in metrics
        assert httpx.get(f"{running.base_url}/health").status_code == 200
    finally:
        stop_gateway(running)


def test_replicas_sharing_a_state_store_share_stored_responses(tmp_path: Path) -> None:
    valkey = ValkeyServer(tmp_path)
    valkey.start()
    config = GatewayConfig(
        server={"responses_store": "state_store", "state_store": valkey.url},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    first, second = start_gateway(config), start_gateway(config)
    try:
        created = _client(first).responses.create(model=MODEL, input="Tell me about the module.", max_output_tokens=8)
        on_second = _client(second)
        assert on_second.responses.retrieve(created.id).output_text == created.output_text
        follow = on_second.responses.create(
            model=MODEL, input="More.", previous_response_id=created.id, max_output_tokens=4
        )
        assert _client(first).responses.retrieve(follow.id).previous_response_id == created.id
        _client(first).responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            on_second.responses.retrieve(created.id)
    finally:
        stop_gateway(first)
        stop_gateway(second)
        valkey.kill()
    with pytest.raises(ValidationError, match="state_store"):
        GatewayConfig(server={"responses_store": "state_store"})

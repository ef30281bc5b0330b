"""Stored responses: every store kind keeps them per owner and within a byte bound; SQLite outlives the gateway,
memory does not; expiry; writes that fail are counted, never fatal."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from pydantic import ValidationError

from gateway.config import GatewayConfig
from gateway.responses.memory_store import MemoryResponseStore
from gateway.responses.records import NOT_KEPT, ResponseStore, ResponseStoreError, StoredResponse
from gateway.responses.redis_store import RedisResponseStore
from gateway.responses.sqlite_store import SQLiteResponseStore
from gateway.responses.store import StoredResponses, open_response_store

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway
from ..valkey import ValkeyServer


def _gateway(store: str) -> RunningGateway:
    return start_gateway(
        GatewayConfig(
            server={"stores": {"responses_store": store}},
            backends=[{"name": "reference", "kind": "reference"}],
            models=[{"name": MODEL, "backends": ["reference"]}],
        )
    )


def _client(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


OWNER = "name:team-a"


def _record(response_id: str, created_at: float, previous: str | None = None, owner: str = OWNER) -> StoredResponse:
    body = {"id": response_id, "object": "response", "output": []}
    return StoredResponse(response_id, created_at, body, [{"id": "msg_1", "type": "message"}], previous, owner)


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


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store_kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., ResponseStore]]:
    """Builds a store of each kind (a real valkey-server for redis, emptied for every test)."""
    if request.param == "redis":
        server: ValkeyServer = request.getfixturevalue("valkey")
        server.flush()
        yield lambda **settings: open_response_store(server.url, **settings)
    elif request.param == "sqlite":
        yield lambda **settings: open_response_store(f"sqlite://{tmp_path}/r.sqlite3", **settings)
    else:
        yield lambda **settings: open_response_store("memory", **settings)


@pytest.fixture(params=["memory", "sqlite"])
def clocked_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ResponseStore, list[float]]:
    """Stores that expire by the injected clock (Redis expires by its own TTL, on its own clock)."""
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
        got = await store.get("resp_new", OWNER)
        assert got is not None and got.previous_response_id == "resp_old" and got.input_items[0]["id"] == "msg_1"
        assert (await store.get("resp_old", OWNER)) is not None
        now[0] += 31  # resp_old is 61 s old, resp_new 31 s
        assert (await store.get("resp_old", OWNER)) is None
        assert (await store.get("resp_new", OWNER)) is not None
        assert await store.delete("resp_new", OWNER)
        assert not await store.delete("resp_new", OWNER)
        assert (await store.get("resp_new", OWNER)) is None
    finally:
        await store.close()


async def test_a_store_answers_only_the_owner_of_a_response(store_kind: Callable[..., ResponseStore]) -> None:
    store = store_kind(max_age=3600)
    try:
        await store.put(_record("resp_a", created_at=time.time()))
        assert await store.get("resp_a", "name:team-b") is None
        assert not await store.delete("resp_a", "name:team-b"), "another tenant cannot delete it"
        found = await store.get("resp_a", OWNER)
        assert found is not None and found.owner == OWNER and found.response["id"] == "resp_a"
        assert await store.delete("resp_a", OWNER)
        assert await store.get("resp_a", OWNER) is None
    finally:
        await store.close()


def _sized(response_id: str, created_at: float, size: int) -> StoredResponse:
    """A record whose serialized response plus input items take exactly ``size`` bytes."""
    record = _record(response_id, created_at)
    base = len(orjson.dumps(record.response)) + len(orjson.dumps(record.input_items))
    record.response["pad"] = ""
    record.response["pad"] = "x" * (size - base - len(b',"pad":""'))
    assert len(orjson.dumps(record.response)) + len(orjson.dumps(record.input_items)) == size
    return record


async def test_every_store_is_bounded_in_bytes_and_drops_the_oldest_first(
    store_kind: Callable[..., ResponseStore],
) -> None:
    store = store_kind(max_age=3600, max_bytes=10_000)
    now = time.time()
    try:
        assert [await store.put(_sized(f"resp_{i}", now + i, 3000)) for i in range(3)] == [0, 0, 0]
        assert await store.put(_sized("resp_3", now + 3, 3000)) == 1, "9,000 + 3,000 bytes: the oldest goes"
        assert await store.put(_sized("resp_4", now + 4, 7000)) == 2, "it needs the room of two"
        kept = [i for i in range(5) if await store.get(f"resp_{i}", OWNER) is not None]
        assert kept == [3, 4]
        assert await store.put(_sized("resp_big", now + 5, 10_001)) == NOT_KEPT, "larger than the whole bound"
        assert await store.get("resp_big", OWNER) is None
        assert [i for i in range(5) if await store.get(f"resp_{i}", OWNER) is not None] == [3, 4], "nothing lost"
        assert await store.delete("resp_3", OWNER)
        assert await store.put(_sized("resp_5", now + 6, 3000)) == 0, "a deleted response gave its room back"
    finally:
        await store.close()


async def test_an_sqlite_file_of_the_previous_schema_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, previous_response_id TEXT, "
        "response BLOB NOT NULL, input_items BLOB NOT NULL);"
    )
    old.execute("INSERT INTO responses VALUES ('resp_old', ?, NULL, ?, '[]')", (time.time(), b'{"id":"resp_old"}'))
    old.commit()
    old.close()
    store = SQLiteResponseStore(path, max_bytes=1024)
    try:
        found = await store.get("resp_old", "")
        assert found is not None and found.owner == "", "what had no owner belongs to the gateway without keys"
        assert await store.get("resp_old", OWNER) is None
        assert await store.put(_sized("resp_new", time.time(), 1010)) == 1, "the old response's bytes count"
    finally:
        await store.close()


async def test_a_write_failure_is_counted_and_never_raised() -> None:
    class FailingStore(MemoryResponseStore):
        """Test double: a store whose writes fail."""

        async def put(self, record: StoredResponse) -> int:
            raise ResponseStoreError("disk on fire")

    stored = StoredResponses(FailingStore())
    await stored.save(_record("resp_1", created_at=0.0))
    assert stored.failed._value.get() == 1 and stored.written._value.get() == 0
    await stored.aclose()


def test_store_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_GATEWAY_STATE", str(tmp_path / "state"))
    default = open_response_store("sqlite", max_age=None)
    assert isinstance(default, SQLiteResponseStore) and default.path == tmp_path / "state" / "responses.sqlite3"
    monkeypatch.delenv("DEEPINFER_GATEWAY_STATE")
    monkeypatch.setenv("DEEPINFER_GATEWAY_CACHE", str(tmp_path))
    default = open_response_store("sqlite", max_age=None)
    assert isinstance(default, SQLiteResponseStore) and default.path == tmp_path / "responses.sqlite3"
    assert isinstance(open_response_store("memory", max_age=None), MemoryResponseStore)
    explicit = open_response_store(f"sqlite://{tmp_path}/x.db", max_age=None)
    assert isinstance(explicit, SQLiteResponseStore) and explicit.path == tmp_path / "x.db"
    assert isinstance(open_response_store("redis://localhost:6379/1", max_age=None), RedisResponseStore)
    with pytest.raises(ValidationError, match="responses_store"):
        GatewayConfig(server={"stores": {"responses_store": "mysql://localhost"}})
    with pytest.raises(ValidationError, match="memory keeps responses in one process"):
        GatewayConfig(server={"stores": {"responses_store": "memory"}, "runtime": {"workers": 2}})
    assert (
        GatewayConfig(
            server={"stores": {"responses_store": "sqlite"}, "runtime": {"workers": 2}}
        ).server.runtime.workers
        == 2
    )


def test_a_store_that_cannot_write_is_counted_and_answers_500s_never_crashes(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    running = _gateway(f"sqlite://{blocker}/responses.sqlite3")
    try:
        client = _client(running)
        created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert created.output_text is not None
        with captured_logs(running) as logs, pytest.raises(openai.InternalServerError) as caught:
            client.responses.retrieve(created.id)
        request_id = caught.value.response.headers["x-request-id"]
        message = caught.value.response.json()["error"]["message"]
        assert message == f"The server had an error processing your request. (request id {request_id})"
        assert "sqlite" not in caught.value.response.text.lower() and str(blocker) not in caught.value.response.text
        (line,) = [line for line in logs if line.get("event") == "request" and line["request_id"] == request_id]
        assert str(blocker) in line["error_detail"], "the detail goes to the log"
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert "gateway_response_store_write_failures_total 1.0" in metrics
        assert "gateway_responses_stored_total 0.0" in metrics
        assert httpx.get(f"{running.base_url}/health").status_code == 200
    finally:
        stop_gateway(running)


@pytest.mark.parametrize("shared", ["own instance", "state_store"])
def test_replicas_sharing_a_redis_store_share_stored_responses(valkey: ValkeyServer, shared: str) -> None:
    stores = {"responses_store": valkey.url} if shared == "own instance" else {"responses_store": "state_store"}
    config = GatewayConfig(
        server={"stores": {**stores, "state_store": valkey.url}},
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
    with pytest.raises(ValidationError, match="state_store"):
        GatewayConfig(server={"stores": {"responses_store": "state_store"}})


KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-0123456789"
ADMIN = "sk-admin-0123456789"


@pytest.fixture(scope="module", params=["memory", "sqlite", "redis"])
def tenants(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """Two tenants (keys named team-a and team-b) and an admin key, on each kind of response store."""
    stores = {
        "memory": "memory",
        "sqlite": f"sqlite://{tmp_path_factory.mktemp('tenants')}/r.sqlite3",
        "redis": request.getfixturevalue("valkey").url if request.param == "redis" else "",
    }
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [{"key": KEY_A, "name": "team-a"}, {"key": KEY_B, "name": "team-b"}],
                "admin_api_key": ADMIN,
            },
            "stores": {"responses_store": stores[request.param]},
        },
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_another_tenants_response_is_exactly_as_unknown_as_an_id_that_never_existed(tenants: RunningGateway) -> None:
    def as_(key: str) -> httpx.Client:
        return httpx.Client(base_url=tenants.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    owner = openai.OpenAI(base_url=f"{tenants.base_url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
    created = owner.responses.create(model=MODEL, input="the secret plan of team a", max_output_tokens=4)
    unknown = "resp_" + "0" * 32

    def same_as_unknown(method: str, path: str, body: dict[str, object] | None = None) -> int:
        """Another tenant's id and an id that never existed get the same status and body (ids aside)."""
        answers = []
        with as_(KEY_B) as other:
            for response_id in (created.id, unknown):
                chained = {**body, "previous_response_id": response_id} if body is not None else None
                answers.append(other.request(method, path.format(id=response_id), json=chained))
        theirs, never = answers
        assert theirs.status_code == never.status_code, (method, path, theirs.text)
        assert theirs.json() == orjson.loads(never.content.replace(unknown.encode(), created.id.encode()))
        assert "secret" not in theirs.text
        return theirs.status_code

    assert same_as_unknown("GET", "/v1/responses/{id}") == 404
    assert same_as_unknown("GET", "/v1/responses/{id}/input_items") == 404
    assert same_as_unknown("DELETE", "/v1/responses/{id}") == 404
    for stream in (False, True):  # previous_response_not_found, as OpenAI answers an unknown previous response
        chained = {"model": MODEL, "input": "go on", "max_output_tokens": 4, "stream": stream}
        assert same_as_unknown("POST", "/v1/responses", chained) == 400
    with as_(ADMIN) as admin:
        assert admin.get(f"/v1/responses/{created.id}").status_code == 401, "the admin key reads no conversation"

    assert owner.responses.retrieve(created.id).output_text == created.output_text, "the other key deleted nothing"
    assert [i.id for i in owner.responses.input_items.list(created.id).data]
    follow = owner.responses.create(model=MODEL, input="more", previous_response_id=created.id, max_output_tokens=4)
    assert follow.previous_response_id == created.id
    owner.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(created.id)


def test_a_response_is_in_the_store_before_its_last_event_or_body_goes_out(tmp_path: Path) -> None:
    """A client's next request (on another replica, say) must find the response it just received: the store write
    is awaited before the terminal event and before a whole body. The store double takes its time to write."""

    class SlowStore(MemoryResponseStore):
        """Test double: the memory store, with the latency of a remote store on every write."""

        async def put(self, record: StoredResponse) -> int:
            await asyncio.sleep(0.3)
            return await super().put(record)

    running = _gateway("memory")
    slow = SlowStore()
    running.state.responses = StoredResponses(slow)
    try:
        client = _client(running)
        whole = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert asyncio.run(slow.get(whole.id, "")) is not None, "stored before the body was sent"
        with client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
            for event in stream:
                if event.type == "response.completed":
                    assert asyncio.run(slow.get(event.response.id, "")) is not None, "stored before the event"
    finally:
        stop_gateway(running)


def test_responses_past_the_byte_bound_are_dropped_oldest_first_and_counted() -> None:
    running = start_gateway(
        GatewayConfig(
            server={"stores": {"responses_store": "memory", "responses_max_bytes": 8192}},
            backends=[{"name": "reference", "kind": "reference"}],
            models=[{"name": MODEL, "backends": ["reference"]}],
        )
    )
    try:
        client = _client(running)
        ids = [client.responses.create(model=MODEL, input="x" * 1500, max_output_tokens=4).id for _ in range(4)]
        assert running.metric("gateway_responses_evicted_total") >= 1
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert client.responses.retrieve(ids[-1]).id == ids[-1]
    finally:
        stop_gateway(running)

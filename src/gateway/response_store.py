"""Stored Responses API responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Stores plug in behind ``ResponseStore`` (an SQLite file by default, memory for tests and throw-away setups; a
shared store such as Redis can follow). ``StoredResponses`` sits in front of the configured store: writes are
handed off without holding up the reply, and a read of an id whose write is still under way waits for it, so a
client that chains on a response right after it completed always finds it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson
from prometheus_client import CollectorRegistry, Counter

from backends.errors import BackendError

if TYPE_CHECKING:
    from redis.asyncio import Redis

logger = logging.getLogger(__name__)
T = TypeVar("T")
Clock = Callable[[], float]
MEMORY = "memory"
SQLITE = "sqlite"
STATE_STORE = "state_store"
SQLITE_FILE_NAME = "responses.sqlite3"


class ResponseStoreError(BackendError):
    """The store could not be read or written (a 500: the client did nothing wrong)."""


@dataclass(slots=True)
class StoredResponse:
    """One stored response: the body as sent, this request's own input items and the response it continued."""

    id: str
    created_at: float  # seconds since the epoch; records older than the store's max_age are dropped
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None


class ResponseStore(Protocol):
    """Where stored responses live. Implementations must not block the event loop."""

    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str) -> bool:
        """True if the response existed."""
        ...

    async def close(self) -> None: ...


MEMORY_MAX_RECORDS = 10_000


class MemoryResponseStore:
    """Responses in a dict: lost on restart, not shared between processes, the newest ``max_records`` only."""

    def __init__(
        self, *, max_age: float | None = None, max_records: int = MEMORY_MAX_RECORDS, clock: Clock = time.time
    ) -> None:
        self._records: dict[str, StoredResponse] = {}  # insertion order is creation order
        self._max_age = max_age
        self._max_records = max_records
        self._clock = clock

    async def put(self, record: StoredResponse) -> None:
        self._expire()
        self._records[record.id] = record
        while len(self._records) > self._max_records:
            del self._records[next(iter(self._records))]

    async def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._records.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    async def close(self) -> None:
        self._records.clear()

    def _expire(self) -> None:
        if self._max_age is None:
            return
        oldest = self._clock() - self._max_age
        while self._records:
            first = next(iter(self._records.values()))
            if first.created_at >= oldest:
                break
            del self._records[first.id]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    previous_response_id TEXT,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


class SQLiteResponseStore:
    """Responses in an SQLite file, shared by the processes of one host. Every call runs on the store's own
    thread (opened on first use, so a gateway that never stores a response never creates the file)."""

    def __init__(self, path: Path, *, max_age: float | None = None, clock: Clock = time.time) -> None:
        self.path = path
        self._max_age = max_age
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._connection: sqlite3.Connection | None = None

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        except (sqlite3.Error, OSError) as exc:
            logger.exception("response store %s failed", self.path)
            raise ResponseStoreError(f"The response store failed: {exc}") from exc

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, isolation_level=None)  # autocommit: one statement per change
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA busy_timeout=5000")
            connection.executescript(_SCHEMA)
            self._connection = connection
        return self._connection

    async def put(self, record: StoredResponse) -> None:
        await self._run(self._put, record)

    def _put(self, record: StoredResponse) -> None:
        db = self._db()
        if self._max_age is not None:
            db.execute("DELETE FROM responses WHERE created_at < ?", (self._clock() - self._max_age,))
        db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
            (
                record.id,
                record.created_at,
                record.previous_response_id,
                orjson.dumps(record.response),
                orjson.dumps(record.input_items),
            ),
        )

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._run(self._get, response_id)

    def _get(self, response_id: str) -> StoredResponse | None:
        row = (
            self._db()
            .execute(
                "SELECT id, created_at, previous_response_id, response, input_items FROM responses WHERE id = ?",
                (response_id,),
            )
            .fetchone()
        )
        if row is None:
            return None
        if self._max_age is not None and row[1] < self._clock() - self._max_age:
            return None
        return StoredResponse(row[0], row[1], orjson.loads(row[3]), orjson.loads(row[4]), row[2])

    async def delete(self, response_id: str) -> bool:
        return await self._run(self._delete, response_id)

    def _delete(self, response_id: str) -> bool:
        return self._db().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    async def close(self) -> None:
        await self._run(self._close)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class RedisResponseStore:
    """Responses in the shared state store (Redis or Valkey, ``server.state_store``): every front-end process
    and replica sees every response. Redis expires them after ``max_age``."""

    def __init__(self, client: Redis, *, max_age: float | None = None, prefix: str = "gateway:response:") -> None:
        from redis.exceptions import RedisError  # only a gateway with a state store needs redis

        self._failures: tuple[type[BaseException], ...] = (RedisError,)
        self._client = client  # owned by the SharedStateStore, which closes it
        self._max_age = max_age
        self._prefix = prefix

    async def _call(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except (TimeoutError, OSError, *self._failures) as exc:
            raise ResponseStoreError(f"The response store failed: {exc}") from exc

    async def put(self, record: StoredResponse) -> None:
        value = orjson.dumps(
            {
                "id": record.id,
                "created_at": record.created_at,
                "response": record.response,
                "input_items": record.input_items,
                "previous_response_id": record.previous_response_id,
            }
        )
        expiry = max(1, round(self._max_age)) if self._max_age is not None else None
        await self._call(self._client.set(self._prefix + record.id, value, ex=expiry))

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self._call(self._client.get(self._prefix + response_id))
        return StoredResponse(**orjson.loads(raw)) if raw is not None else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call(self._client.delete(self._prefix + response_id)))

    async def close(self) -> None:
        return None


def default_sqlite_path() -> Path:
    """``responses.sqlite3`` in ``$DEEPINFER_GATEWAY_CACHE`` or ``~/.cache/deepinfer-gateway``."""
    configured = os.environ.get("DEEPINFER_GATEWAY_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "deepinfer-gateway"
    return base / SQLITE_FILE_NAME


def open_response_store(
    spec: str, *, max_age: float | None, shared: Redis | None = None, clock: Clock = time.time
) -> ResponseStore:
    """``memory``, ``sqlite`` (the default file), ``sqlite://PATH`` (``sqlite:///var/lib/x.db`` is absolute), or
    ``state_store`` (the shared Redis client, ``shared``)."""
    if spec == STATE_STORE:
        if shared is None:
            raise ValueError("responses_store 'state_store' needs server.state_store")
        return RedisResponseStore(shared, max_age=max_age)
    if spec == MEMORY:
        return MemoryResponseStore(max_age=max_age, clock=clock)
    if spec == SQLITE:
        return SQLiteResponseStore(default_sqlite_path(), max_age=max_age, clock=clock)
    if spec.startswith("sqlite://") and len(spec) > len("sqlite://"):
        return SQLiteResponseStore(Path(spec.removeprefix("sqlite://")).expanduser(), max_age=max_age, clock=clock)
    raise ValueError(f"unknown response store {spec!r}: expected memory, sqlite, sqlite://PATH or state_store")


class StoredResponses:
    """The gateway's view of the store: writes in the background with read-your-writes, and chains."""

    def __init__(self, store: ResponseStore, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self._pending: dict[str, asyncio.Task[None]] = {}
        self.written = Counter(
            "gateway_responses_stored", "Responses written to the response store.", registry=registry
        )
        self.failed = Counter(
            "gateway_response_store_write_failures", "Responses the store failed to write.", registry=registry
        )

    def save(self, record: StoredResponse) -> None:
        """Starts writing ``record``; ``get`` and ``delete`` of its id wait until the write is done."""
        task = asyncio.get_running_loop().create_task(self.store.put(record))
        self._pending[record.id] = task
        task.add_done_callback(lambda done: self._written(record.id, done))

    def _written(self, response_id: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(response_id) is task:
            del self._pending[response_id]
        if task.cancelled() or task.exception() is not None:
            self.failed.inc()
            logger.error(
                "storing response %s failed: %s", response_id, "cancelled" if task.cancelled() else task.exception()
            )
        else:
            self.written.inc()

    async def _settled(self, response_id: str) -> None:
        pending = self._pending.get(response_id)
        if pending is not None:
            await asyncio.wait((pending,))

    async def get(self, response_id: str) -> StoredResponse | None:
        await self._settled(response_id)
        return await self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        await self._settled(response_id)
        return await self.store.delete(response_id)

    async def chain(self, response_id: str, max_records: int) -> list[StoredResponse] | None:
        """The response and those it continued, oldest first; None if one of them is gone (deleted, expired)."""
        records: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None and len(records) < max_records:
            record = await self.get(next_id)
            if record is None:
                return None
            records.append(record)
            next_id = record.previous_response_id
        records.reverse()
        return records

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending.values()))
        await self.store.close()

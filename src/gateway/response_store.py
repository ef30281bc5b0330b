"""Stored Responses API responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Every response belongs to the tenant that created it (``gateway.auth.request_owner``): a store answers a read or
a delete only for that owner, so another tenant's id is exactly as unknown as an id that never existed.

Stores plug in behind ``ResponseStore``: an SQLite file (the default), memory (one process only), or Redis/Valkey
(shared by every process and replica). Each is bounded in bytes (``server.responses_max_bytes``, counted as the
serialized response plus its input items): a write that takes a store past it drops the oldest responses first,
and ``StoredResponses`` counts them. A write is awaited before the response's last event or body goes out, so a
client that chains on a response it just received always finds it, on any process or replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

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
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
SQLITE_FILE_NAME = "responses.sqlite3"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


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
    owner: str
    """The tenant that created it (``gateway.auth.request_owner``); nobody else reads or deletes it."""


class _Serialized(NamedTuple):
    response: bytes
    input_items: bytes

    @property
    def size(self) -> int:
        return len(self.response) + len(self.input_items)


def _serialized(record: StoredResponse) -> _Serialized:
    return _Serialized(orjson.dumps(record.response), orjson.dumps(record.input_items))


NOT_KEPT = -1
"""What ``put`` returns for a record larger than the store's whole byte bound: it is not stored."""


class ResponseStore(Protocol):
    """Where stored responses live. Implementations must not block the event loop."""

    async def put(self, record: StoredResponse) -> int:
        """Stores ``record`` and returns how many older responses it evicted to stay within the byte bound
        (``NOT_KEPT``: the record alone is larger than the bound, and nothing changed)."""
        ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, has not expired and belongs to ``owner``."""
        ...

    async def delete(self, response_id: str, owner: str) -> bool:
        """True if the response existed and belonged to ``owner`` (then it is gone)."""
        ...

    async def close(self) -> None: ...


class _MemoryRecord(NamedTuple):
    owner: str
    created_at: float
    previous_response_id: str | None
    blob: _Serialized


class MemoryResponseStore:
    """Responses in this process (lost on restart), kept serialized so their size is what the bound counts."""

    def __init__(
        self, *, max_age: float | None = None, max_bytes: int = DEFAULT_MAX_BYTES, clock: Clock = time.time
    ) -> None:
        self._records: OrderedDict[str, _MemoryRecord] = OrderedDict()  # oldest first
        self._max_age = max_age
        self._max_bytes = max_bytes
        self._clock = clock
        self.bytes = 0

    async def put(self, record: StoredResponse) -> int:
        self._expire()
        blob = _serialized(record)
        if blob.size > self._max_bytes:
            return NOT_KEPT
        self._drop(record.id)
        self._records[record.id] = _MemoryRecord(record.owner, record.created_at, record.previous_response_id, blob)
        self.bytes += blob.size
        evicted = 0
        while self.bytes > self._max_bytes:
            self._drop(next(iter(self._records)))
            evicted += 1
        return evicted

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        self._expire()
        found = self._records.get(response_id)
        if found is None or found.owner != owner:
            return None
        response, items = orjson.loads(found.blob.response), orjson.loads(found.blob.input_items)
        return StoredResponse(response_id, found.created_at, response, items, found.previous_response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        found = self._records.get(response_id)
        if found is None or found.owner != owner:
            return False
        self._drop(response_id)
        return True

    async def close(self) -> None:
        self._records.clear()
        self.bytes = 0

    def _drop(self, response_id: str) -> None:
        found = self._records.pop(response_id, None)
        if found is not None:
            self.bytes -= found.blob.size

    def _expire(self) -> None:
        if self._max_age is None:
            return
        oldest = self._clock() - self._max_age
        while self._records:
            first_id, first = next(iter(self._records.items()))
            if first.created_at >= oldest:
                break
            self._drop(first_id)


SCHEMA_VERSION = 2
"""1: no owner and no sizes (before responses had tenants and the store a byte bound)."""
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        previous_response_id TEXT,
        response BLOB NOT NULL,
        input_items BLOB NOT NULL,
        owner TEXT NOT NULL DEFAULT '',
        bytes INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at)",
    "CREATE TABLE IF NOT EXISTS usage (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO usage VALUES (0, (SELECT coalesce(sum(bytes), 0) FROM responses))",
    """CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses
        BEGIN UPDATE usage SET bytes = bytes + NEW.bytes; END""",
    """CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses
        BEGIN UPDATE usage SET bytes = bytes - OLD.bytes; END""",
)
_UPGRADE_FROM_1 = (  # a file of version 1 has no owner and no sizes: its responses go to the single owner
    "ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0",
    "UPDATE responses SET bytes = length(response) + length(input_items)",
)


class SQLiteResponseStore:
    """Responses in an SQLite file, shared by the processes of one host. Every call runs on the store's own
    thread (opened on first use, so a gateway that never stores a response never creates the file). The bytes
    stored are kept by triggers in a one-row table, so the bound costs no scan."""

    def __init__(
        self,
        path: Path,
        *,
        max_age: float | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Clock = time.time,
    ) -> None:
        self.path = path
        self._max_age = max_age
        self._max_bytes = max_bytes
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._connection: sqlite3.Connection | None = None

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        except (sqlite3.Error, OSError) as exc:
            logger.exception("response store %s failed", self.path)
            raise ResponseStoreError(f"The response store {self.path} failed: {exc}") from exc

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, isolation_level=None)  # autocommit unless BEGIN
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA busy_timeout=5000")
                connection.execute("BEGIN IMMEDIATE")  # one process creates or upgrades the schema
                version = connection.execute("PRAGMA user_version").fetchone()[0]
                exists = connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'responses'").fetchone()
                if exists and version < SCHEMA_VERSION:
                    for statement in _UPGRADE_FROM_1:
                        connection.execute(statement)
                for statement in _SCHEMA:
                    connection.execute(statement)
                connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                connection.execute("COMMIT")
            except BaseException:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    async def put(self, record: StoredResponse) -> int:
        blob = await asyncio.to_thread(_serialized, record) if _large(record) else _serialized(record)
        return await self._run(self._put, record, blob)

    def _put(self, record: StoredResponse, blob: _Serialized) -> int:
        if blob.size > self._max_bytes:
            return NOT_KEPT
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            if self._max_age is not None:
                db.execute("DELETE FROM responses WHERE created_at < ?", (self._clock() - self._max_age,))
            db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.created_at,
                    record.previous_response_id,
                    blob.response,
                    blob.input_items,
                    record.owner,
                    blob.size,
                ),
            )
            evicted = 0
            while db.execute("SELECT bytes FROM usage").fetchone()[0] > self._max_bytes:
                evicted += db.execute(
                    "DELETE FROM responses WHERE rowid = "
                    "(SELECT rowid FROM responses WHERE id != ? ORDER BY created_at, rowid LIMIT 1)",
                    (record.id,),
                ).rowcount
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return evicted

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return await self._run(self._get, response_id, owner)

    def _get(self, response_id: str, owner: str) -> StoredResponse | None:
        row = (
            self._db()
            .execute(
                "SELECT created_at, previous_response_id, response, input_items FROM responses "
                "WHERE id = ? AND owner = ?",
                (response_id, owner),
            )
            .fetchone()
        )
        if row is None:
            return None
        if self._max_age is not None and row[0] < self._clock() - self._max_age:
            return None
        return StoredResponse(response_id, row[0], orjson.loads(row[2]), orjson.loads(row[3]), row[1], owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._run(self._delete, response_id, owner)

    def _delete(self, response_id: str, owner: str) -> bool:
        deleted = self._db().execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return deleted.rowcount > 0

    async def close(self) -> None:
        await self._run(self._close)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _large(record: StoredResponse) -> bool:
    """A record worth serializing off the event loop (a long conversation's items)."""
    return sum(len(str(item.get("content", ""))) for item in record.input_items) > 256 * 1024


HASH_TAG = "{responses}"
"""Every key of the Redis store carries this hash tag: a put's script touches several of them (the record, the age
index, the sizes), and Redis Cluster runs a multi-key script only over keys of one slot."""

# KEYS: record, age index (zset id -> created_at), sizes (hash id -> bytes), total bytes, owners (hash id -> owner).
# ARGV: id, value, size, created_at, max_bytes, ttl seconds (0: none), oldest created_at kept ('': no max age),
#       prefix of record keys, owner. Returns the number of responses evicted (-1: larger than the bound, not stored).
_PUT_SCRIPT = """
local size = tonumber(ARGV[3])
local max_bytes = tonumber(ARGV[5])
if size > max_bytes then return -1 end
local function drop(id)
  local bytes = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('DEL', ARGV[8] .. id)
  redis.call('DECRBY', KEYS[4], bytes)
end
if ARGV[7] ~= '' then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[7])) do drop(id) end
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then drop(ARGV[1]) end
local ttl = tonumber(ARGV[6])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[2])
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('HSET', KEYS[5], ARGV[1], ARGV[9])
local total = redis.call('INCRBY', KEYS[4], size)
local evicted = 0
while total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if oldest == nil or oldest == ARGV[1] then break end
  drop(oldest)
  evicted = evicted + 1
  total = tonumber(redis.call('GET', KEYS[4]))
end
return evicted
"""

# KEYS: record, age index, sizes, total bytes, owners. ARGV: id, owner. Returns 1 when it deleted the owner's
# response (an expired record's index entries go at the next put's age sweep).
_DELETE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[2] then return 0 end
local bytes = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('DECRBY', KEYS[4], bytes)
return 1
"""


class RedisResponseStore:
    """Responses in Redis or Valkey: every front-end process and replica sees every response. Its own instance
    (``responses_store: redis://...``) keeps them from ever crowding out the budgets of ``server.state_store``;
    ``state_store`` shares that instance, and then only this store's byte bound keeps them apart."""

    def __init__(
        self,
        client: Redis,
        *,
        owns_client: bool,
        max_age: float | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Clock = time.time,
        prefix: str = "gateway:response:",
    ) -> None:
        from redis.exceptions import RedisError  # only a gateway with a Redis store needs redis

        self._failures: tuple[type[BaseException], ...] = (RedisError,)
        self._client = client
        self._owns_client = owns_client  # a shared state store's client is closed by its SharedStateStore
        self._max_age = max_age
        self._max_bytes = max_bytes
        self._clock = clock
        self._records = f"{prefix}{HASH_TAG}:"
        self._index = [f"{prefix}{HASH_TAG}#{name}" for name in ("age", "sizes", "bytes", "owners")]
        self._put = client.register_script(_PUT_SCRIPT)
        self._delete = client.register_script(_DELETE_SCRIPT)

    async def _call(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except (TimeoutError, OSError, *self._failures) as exc:
            raise ResponseStoreError(f"The response store failed: {exc}") from exc

    def keys_of(self, response_id: str) -> list[str]:
        """The keys one put or delete of ``response_id`` touches (all of one Redis Cluster slot)."""
        return [self._records + response_id, *self._index]

    async def put(self, record: StoredResponse) -> int:
        blob = await asyncio.to_thread(_serialized, record) if _large(record) else _serialized(record)
        value = b"".join(
            (
                b'{"id":',
                orjson.dumps(record.id),
                b',"created_at":',
                orjson.dumps(record.created_at),
                b',"owner":',
                orjson.dumps(record.owner),
                b',"previous_response_id":',
                orjson.dumps(record.previous_response_id),
                b',"response":',
                blob.response,
                b',"input_items":',
                blob.input_items,
                b"}",
            )
        )
        ttl = max(1, round(self._max_age)) if self._max_age is not None else 0
        oldest = repr(self._clock() - self._max_age) if self._max_age is not None else ""
        args = [record.id, value, blob.size, repr(record.created_at), self._max_bytes, ttl, oldest, self._records]
        args.append(record.owner)
        return int(await self._call(self._put(keys=self.keys_of(record.id), args=args)))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        raw = await self._call(self._client.get(self._records + response_id))
        if raw is None:
            return None
        found = orjson.loads(raw)
        if found["owner"] != owner:
            return None
        return StoredResponse(**found)

    async def delete(self, response_id: str, owner: str) -> bool:
        return bool(await self._call(self._delete(keys=self.keys_of(response_id), args=[response_id, owner])))

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def default_sqlite_path() -> Path:
    """``responses.sqlite3`` in ``$DEEPINFER_GATEWAY_CACHE`` or ``~/.cache/deepinfer-gateway``."""
    configured = os.environ.get("DEEPINFER_GATEWAY_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "deepinfer-gateway"
    return base / SQLITE_FILE_NAME


def open_response_store(
    spec: str,
    *,
    max_age: float | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    shared: Redis | None = None,
    clock: Clock = time.time,
) -> ResponseStore:
    """``memory``, ``sqlite`` (the default file), ``sqlite://PATH`` (``sqlite:///var/lib/x.db`` is absolute),
    ``redis://...`` (a Redis or Valkey of its own; ``rediss://`` and ``unix://`` too) or ``state_store`` (the
    shared state store's client, ``shared``)."""
    if spec == STATE_STORE:
        if shared is None:
            raise ValueError("responses_store 'state_store' needs server.state_store")
        return RedisResponseStore(shared, owns_client=False, max_age=max_age, max_bytes=max_bytes, clock=clock)
    if spec.startswith(REDIS_SCHEMES):
        from redis.asyncio import Redis

        client = Redis.from_url(spec, socket_timeout=2.0, socket_connect_timeout=2.0)
        return RedisResponseStore(client, owns_client=True, max_age=max_age, max_bytes=max_bytes, clock=clock)
    if spec == MEMORY:
        return MemoryResponseStore(max_age=max_age, max_bytes=max_bytes, clock=clock)
    if spec == SQLITE:
        return SQLiteResponseStore(default_sqlite_path(), max_age=max_age, max_bytes=max_bytes, clock=clock)
    if spec.startswith("sqlite://") and len(spec) > len("sqlite://"):
        path = Path(spec.removeprefix("sqlite://")).expanduser()
        return SQLiteResponseStore(path, max_age=max_age, max_bytes=max_bytes, clock=clock)
    raise ValueError(
        f"unknown response store {spec!r}: expected memory, sqlite, sqlite://PATH, redis://... or state_store"
    )


class StoredResponses:
    """The gateway's view of the store: awaited writes that never fail a request, owners, chains, metrics."""

    def __init__(self, store: ResponseStore, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.written = Counter(
            "gateway_responses_stored", "Responses written to the response store.", registry=registry
        )
        self.failed = Counter(
            "gateway_response_store_write_failures", "Responses the store failed to write.", registry=registry
        )
        self.evicted = Counter(
            "gateway_responses_evicted",
            "Stored responses dropped, oldest first, to keep the store within server.responses_max_bytes.",
            registry=registry,
        )

    async def save(self, record: StoredResponse) -> None:
        """Writes ``record``. A failure is logged and counted, never raised: the client still gets its response
        (a later read of it finds nothing, or the store's 500)."""
        try:
            evicted = await self.store.put(record)
        except Exception:
            self.failed.inc()
            logger.exception("storing response %s failed", record.id)
            return
        if evicted == NOT_KEPT:
            self.evicted.inc()
            logger.warning("response %s is larger than server.responses_max_bytes: not stored", record.id)
            return
        self.written.inc()
        self.evicted.inc(evicted)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return await self.store.get(response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self.store.delete(response_id, owner)

    async def chain(self, response_id: str, owner: str, max_records: int) -> list[StoredResponse] | None:
        """The response and those it continued, oldest first; None if one of them is gone (deleted, expired,
        evicted) or is not ``owner``'s."""
        records: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None and len(records) < max_records:
            record = await self.get(next_id, owner)
            if record is None:
                return None
            records.append(record)
            next_id = record.previous_response_id
        records.reverse()
        return records

    async def aclose(self) -> None:
        await self.store.close()

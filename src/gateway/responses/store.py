"""Stored Responses API responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Stores plug in behind ``ResponseStore`` (``gateway.responses.records``): an SQLite file (the default), memory (one
process only), or Redis/Valkey (shared by every process and replica). A write that takes a store past its byte
bound drops the oldest responses first, and ``StoredResponses`` counts them. A write is awaited before the
response's last event or body goes out, so a client that chains on a response it just received always finds it,
on any process or replica.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from gateway.local_state import local_state_dir
from gateway.responses.memory_store import MemoryResponseStore
from gateway.responses.records import DEFAULT_MAX_BYTES, NOT_KEPT, Clock, ResponseStore, StoredResponse
from gateway.responses.redis_store import RedisResponseStore
from gateway.responses.sqlite_store import SQLiteResponseStore

if TYPE_CHECKING:
    from redis.asyncio import Redis

logger = logging.getLogger(__name__)
MEMORY = "memory"
SQLITE = "sqlite"
STATE_STORE = "state_store"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
SQLITE_FILE_NAME = "responses.sqlite3"


def default_sqlite_path() -> Path:
    """``responses.sqlite3`` in the gateway's local state folder (``gateway.local_state``)."""
    return local_state_dir() / SQLITE_FILE_NAME


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
            raise ValueError("responses_store 'state_store' needs server.stores.state_store")
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
            "Stored responses dropped, oldest first, to keep the store within server.stores.responses_max_bytes.",
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
            logger.warning("response %s is larger than server.stores.responses_max_bytes: not stored", record.id)
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

"""``SQLiteResponseStore``: stored responses in an SQLite file, shared by the gateway processes of one host."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.responses.records import (
    DEFAULT_MAX_BYTES,
    NOT_KEPT,
    Clock,
    ResponseStoreError,
    Serialized,
    StoredResponse,
    serialized,
    worth_serializing_off_loop,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
        blob = await asyncio.to_thread(serialized, record) if worth_serializing_off_loop(record) else serialized(record)
        return await self._run(self._put, record, blob)

    def _put(self, record: StoredResponse, blob: Serialized) -> int:
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

"""``SQLiteBatchStore``: the batch store in one SQLite file, shared by the gateway processes of a host (or of every
replica that mounts the same volume, if that volume gives SQLite working locks). Every call runs on the store's own
thread."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.batches.records import (
    CANCELLING,
    ENDED_STATUSES,
    FINALIZING,
    IN_PROGRESS,
    OPEN_STATUSES,
    VALIDATING,
)
from gateway.batches.store import Claim, Result, StoreLimitError

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        purpose TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL,
        object BLOB NOT NULL,
        content BLOB NOT NULL,
        bytes INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at)",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        key_label TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        object BLOB NOT NULL,
        holder TEXT,
        lease_until REAL NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at)",
    "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, lease_until)",
    """CREATE TABLE IF NOT EXISTS results (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        ok INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        result BLOB NOT NULL,
        PRIMARY KEY (batch_id, line)
    )""",
)


class SQLiteBatchStore:
    """The batch store in one SQLite file (the default)."""

    def __init__(self, path: Path, *, max_stored_bytes: int) -> None:
        self.path = path
        self._max_stored_bytes = max_stored_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        self._connection: sqlite3.Connection | None = None

    def exists(self) -> bool:
        """Whether the store's file exists: a gateway that never took a file never creates it."""
        return self._connection is not None or self.path.exists()

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(db, *args)`` on the store's thread, in one transaction."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._transaction, work, *args)

    def _transaction(self, work: Callable[..., T], *args: Any) -> T:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            result = work(db, *args)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA busy_timeout=10000")
            for statement in _SCHEMA:
                connection.execute(statement)
            self._connection = connection
        return self._connection

    async def close(self) -> None:
        def close() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=True)

    # files

    async def add_file(self, file: dict[str, Any], owner: str, content: bytes) -> None:
        await self.run(self._add_file, file, owner, content)

    def _add_file(self, db: sqlite3.Connection, file: dict[str, Any], owner: str, content: bytes) -> None:
        stored = db.execute("SELECT coalesce(sum(bytes), 0) FROM files").fetchone()[0]
        if stored + len(content) > self._max_stored_bytes:
            raise StoreLimitError(
                f"The file store is full ({stored} of {self._max_stored_bytes} bytes): delete files you no longer "
                "need, or wait for old ones to expire.",
                "storage_limit_exceeded",
            )
        _insert_file(db, file, owner, content)

    async def get_file(self, file_id: str, owner: str, now: float) -> dict[str, Any] | None:
        return await self.run(self._get_file, file_id, owner, now)

    def _get_file(self, db: sqlite3.Connection, file_id: str, owner: str, now: float) -> dict[str, Any] | None:
        row = db.execute(
            "SELECT object FROM files WHERE id = ? AND owner = ? AND (expires_at IS NULL OR expires_at > ?)",
            (file_id, owner, now),
        ).fetchone()
        return orjson.loads(row[0]) if row is not None else None

    async def file_content(self, file_id: str, owner: str, now: float) -> bytes | None:
        return await self.run(self._file_content, file_id, owner, now)

    def _file_content(self, db: sqlite3.Connection, file_id: str, owner: str, now: float) -> bytes | None:
        row = db.execute(
            "SELECT content FROM files WHERE id = ? AND owner = ? AND (expires_at IS NULL OR expires_at > ?)",
            (file_id, owner, now),
        ).fetchone()
        return bytes(row[0]) if row is not None else None

    async def list_files(
        self, owner: str, now: float, *, purpose: str | None, after: str | None, limit: int, descending: bool
    ) -> list[dict[str, Any]]:
        return await self.run(self._list_files, owner, now, purpose, after, limit, descending)

    def _list_files(
        self,
        db: sqlite3.Connection,
        owner: str,
        now: float,
        purpose: str | None,
        after: str | None,
        limit: int,
        descending: bool,
    ) -> list[dict[str, Any]]:
        query = "SELECT object FROM files WHERE owner = ? AND (expires_at IS NULL OR expires_at > ?)"
        args: list[Any] = [owner, now]
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            cursor = db.execute("SELECT created_at, rowid FROM files WHERE id = ? AND owner = ?", (after, owner))
            found = cursor.fetchone()
            if found is not None:
                query += " AND (created_at, rowid) < (?, ?)" if descending else " AND (created_at, rowid) > (?, ?)"
                args.extend(found)
        query += f" ORDER BY created_at {'DESC' if descending else 'ASC'}, rowid {'DESC' if descending else 'ASC'}"
        query += " LIMIT ?"
        args.append(limit)
        return [orjson.loads(row[0]) for row in db.execute(query, args)]

    async def delete_file(self, file_id: str, owner: str) -> bool:
        return await self.run(
            lambda db: db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0
        )

    async def purge(self, now: float) -> int:
        """Drops expired files; returns how many."""
        return await self.run(
            lambda db: db.execute("DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)).rowcount
        )

    # batches

    async def add_batch(self, batch: dict[str, Any], owner: str, key_label: str, max_open: int) -> None:
        await self.run(self._add_batch, batch, owner, key_label, max_open)

    def _add_batch(
        self, db: sqlite3.Connection, batch: dict[str, Any], owner: str, key_label: str, max_open: int
    ) -> None:
        marks = ",".join("?" * len(OPEN_STATUSES))
        open_now = db.execute(
            f"SELECT count(*) FROM batches WHERE owner = ? AND status IN ({marks})", (owner, *OPEN_STATUSES)
        ).fetchone()[0]
        if open_now >= max_open:
            raise StoreLimitError(
                f"You have {open_now} batches that have not ended, the most allowed: wait for one to end or cancel "
                "one.",
                "batch_limit_exceeded",
            )
        db.execute(
            "INSERT INTO batches (id, owner, key_label, status, created_at, object) VALUES (?, ?, ?, ?, ?, ?)",
            (batch["id"], owner, key_label, batch["status"], batch["created_at"], orjson.dumps(batch)),
        )

    async def get_batch(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        return await self.run(self._get_batch, batch_id, owner)

    def _get_batch(self, db: sqlite3.Connection, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        if owner is None:
            row = db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = db.execute("SELECT object FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return _with_counts(db, orjson.loads(row[0])) if row is not None else None

    async def list_batches(self, owner: str, *, after: str | None, limit: int) -> list[dict[str, Any]]:
        return await self.run(self._list_batches, owner, after, limit)

    def _list_batches(self, db: sqlite3.Connection, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        query = "SELECT object FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after is not None:
            found = db.execute("SELECT created_at, rowid FROM batches WHERE id = ? AND owner = ?", (after, owner))
            row = found.fetchone()
            if row is not None:
                query += " AND (created_at, rowid) < (?, ?)"
                args.extend(row)
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        args.append(limit)
        return [_with_counts(db, orjson.loads(row[0])) for row in db.execute(query, args)]

    async def cancel(self, batch_id: str, owner: str, now: int) -> dict[str, Any] | None:
        """Marks an open batch ``cancelling`` (its runner ends it as ``cancelled``); an ended one is left as it is.
        None: no such batch of ``owner``'s."""
        return await self.run(self._cancel, batch_id, owner, now)

    def _cancel(self, db: sqlite3.Connection, batch_id: str, owner: str, now: int) -> dict[str, Any] | None:
        batch = self._get_batch(db, batch_id, owner)
        if batch is None:
            return None
        if batch["status"] in (VALIDATING, IN_PROGRESS):
            batch["status"] = CANCELLING
            batch["cancelling_at"] = now
            _write(db, batch)
        return batch

    async def claim(self, holder: str, now: float, lease_seconds: float) -> Claim | None:
        """Takes the lease of the oldest open batch nobody holds (or whose holder let its lease run out)."""
        return await self.run(self._claim, holder, now, lease_seconds)

    def _claim(self, db: sqlite3.Connection, holder: str, now: float, lease_seconds: float) -> Claim | None:
        marks = ",".join("?" * len(OPEN_STATUSES))
        row = db.execute(
            f"SELECT id, owner, key_label FROM batches WHERE status IN ({marks}) AND lease_until < ? "
            "ORDER BY created_at, rowid LIMIT 1",
            (*OPEN_STATUSES, now),
        ).fetchone()
        if row is None:
            return None
        db.execute("UPDATE batches SET holder = ?, lease_until = ? WHERE id = ?", (holder, now + lease_seconds, row[0]))
        batch = self._get_batch(db, row[0], None)
        assert batch is not None
        return Claim(batch, row[1], row[2])

    async def renew(self, batch_id: str, holder: str, now: float, lease_seconds: float) -> dict[str, Any] | None:
        """Extends the lease and returns the batch as stored (a cancel may have come); None: the lease was lost."""
        return await self.run(self._renew, batch_id, holder, now, lease_seconds)

    def _renew(
        self, db: sqlite3.Connection, batch_id: str, holder: str, now: float, lease_seconds: float
    ) -> dict[str, Any] | None:
        renewed = db.execute(
            "UPDATE batches SET lease_until = ? WHERE id = ? AND holder = ?", (now + lease_seconds, batch_id, holder)
        ).rowcount
        return self._get_batch(db, batch_id, None) if renewed else None

    async def release(self, batch_id: str, holder: str) -> None:
        await self.run(
            lambda db: db.execute(
                "UPDATE batches SET holder = NULL, lease_until = 0 WHERE id = ? AND holder = ?", (batch_id, holder)
            )
        )

    async def update(self, batch: dict[str, Any], holder: str) -> bool:
        """Writes the batch's new status and times, if ``holder`` still holds it and it has not ended."""
        return await self.run(self._update, batch, holder)

    def _update(self, db: sqlite3.Connection, batch: dict[str, Any], holder: str) -> bool:
        stored = db.execute("SELECT status, holder FROM batches WHERE id = ?", (batch["id"],)).fetchone()
        if stored is None or stored[1] != holder or stored[0] in ENDED_STATUSES:
            return False
        if stored[0] == CANCELLING and batch["status"] in (IN_PROGRESS, FINALIZING):
            return False  # a cancel came in meanwhile: the runner sees it at its next renewal
        _write(db, batch)
        return True

    # results

    async def add_result(self, batch_id: str, result: Result) -> bool:
        """Records one request's result, unless that line has one already or the batch has ended (a process that
        lost its lease finishing a request late); True when this one was kept."""
        return await self.run(self._add_result, batch_id, result)

    def _add_result(self, db: sqlite3.Connection, batch_id: str, result: Result) -> bool:
        marks = ",".join("?" * len(ENDED_STATUSES))
        ended = db.execute(
            f"SELECT 1 FROM batches WHERE id = ? AND status IN ({marks})", (batch_id, *ENDED_STATUSES)
        ).fetchone()
        if ended is not None:
            return False
        kept = db.execute(
            "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?)",
            (batch_id, result.line, int(result.ok), result.tokens, orjson.dumps(result.result)),
        )
        return kept.rowcount > 0

    async def done_lines(self, batch_id: str) -> set[int]:
        return await self.run(
            lambda db: {row[0] for row in db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}
        )

    async def finish(
        self,
        batch: dict[str, Any],
        holder: str,
        files: list[tuple[dict[str, Any], bytes]],
        owner: str,
    ) -> bool:
        """Ends the batch with its result files, at once: the files are added and the batch written in one
        transaction, so a crash leaves either both or neither. False (nothing written) if ``holder`` lost it."""
        return await self.run(self._finish, batch, holder, files, owner)

    def _finish(
        self,
        db: sqlite3.Connection,
        batch: dict[str, Any],
        holder: str,
        files: list[tuple[dict[str, Any], bytes]],
        owner: str,
    ) -> bool:
        stored = db.execute("SELECT status, holder FROM batches WHERE id = ?", (batch["id"],)).fetchone()
        if stored is None or stored[1] != holder or stored[0] in ENDED_STATUSES:
            return False
        for file, content in files:  # results are stored whatever the bound: they were paid for
            _insert_file(db, file, owner, content)
        # its object keeps its final counts, and its results (now in its files) go
        db.execute(
            "UPDATE batches SET status = ?, object = ?, holder = NULL, lease_until = 0 WHERE id = ?",
            (batch["status"], orjson.dumps(batch), batch["id"]),
        )
        db.execute("DELETE FROM results WHERE batch_id = ?", (batch["id"],))
        return True

    async def results(self, batch_id: str) -> list[Result]:
        return await self.run(
            lambda db: [
                Result(row[0], bool(row[1]), row[2], orjson.loads(row[3]))
                for row in db.execute(
                    "SELECT line, ok, tokens, result FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
                )
            ]
        )

    async def count_by_status(self) -> dict[str, int]:
        return await self.run(
            lambda db: dict(db.execute("SELECT status, count(*) FROM batches GROUP BY status").fetchall())
        )


def _write(db: sqlite3.Connection, batch: dict[str, Any]) -> None:
    stored = {**batch, "request_counts": {"total": batch["request_counts"]["total"], "completed": 0, "failed": 0}}
    db.execute(
        "UPDATE batches SET status = ?, object = ? WHERE id = ?", (batch["status"], orjson.dumps(stored), batch["id"])
    )


def _with_counts(db: sqlite3.Connection, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its progress counted from its results while it runs; an ended batch's object holds its
    final counts."""
    if batch["status"] in ENDED_STATUSES:
        return batch
    counts = dict(db.execute("SELECT ok, count(*) FROM results WHERE batch_id = ? GROUP BY ok", (batch["id"],)))
    batch["request_counts"]["completed"] = counts.get(1, 0)
    batch["request_counts"]["failed"] = counts.get(0, 0)
    return batch


def _insert_file(db: sqlite3.Connection, file: dict[str, Any], owner: str, content: bytes) -> None:
    """One file row: its object, its content and size, under its owner."""
    db.execute(
        "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            file["id"],
            owner,
            file["purpose"],
            file["created_at"],
            file["expires_at"],
            orjson.dumps(file),
            content,
            len(content),
        ),
    )

"""``BatchStore``: files, batches, each request's result and the leases that say which process runs a batch.

Two stores plug in behind it: an SQLite file (``sqlite_store``, the default) and Redis/Valkey with file contents on
a shared volume (``redis_store``, ``server.batches.store: state_store``). In both, a request's result is written once
per ``(batch, line)``: a process that runs a line again (after a crash, or after its lease was taken over) cannot add
a second one, so each ``custom_id`` is in the output or error file exactly once; and a batch's result files and its
final status are written in one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.local_state import local_state_dir

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from gateway.batches.config import BatchesConfig

SQLITE_FILE_NAME = "batches.sqlite3"
STATE_STORE = "state_store"


class StoreLimitError(Exception):
    """A write the store's bounds refuse (a client's to fix: delete files, wait for batches to end)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class Claim:
    """A batch a process holds the lease of: its OpenAI object, and whose key runs it."""

    batch: dict[str, Any]
    owner: str
    key_label: str


@dataclass(frozen=True, slots=True)
class Result:
    line: int
    ok: bool
    tokens: int
    result: dict[str, Any]


class BatchStore(Protocol):
    def exists(self) -> bool:
        """Whether the store may hold anything (a gateway that never took a file creates no SQLite file)."""
        ...

    async def close(self) -> None: ...

    async def add_file(self, file: dict[str, Any], owner: str, content: bytes) -> None:
        """Raises ``StoreLimitError`` past the store's byte bound."""
        ...

    async def get_file(self, file_id: str, owner: str, now: float) -> dict[str, Any] | None: ...
    async def file_content(self, file_id: str, owner: str, now: float) -> bytes | None: ...
    async def list_files(
        self, owner: str, now: float, *, purpose: str | None, after: str | None, limit: int, descending: bool
    ) -> list[dict[str, Any]]: ...
    async def delete_file(self, file_id: str, owner: str) -> bool: ...
    async def purge(self, now: float) -> int:
        """Drops expired files; returns how many."""
        ...

    async def add_batch(self, batch: dict[str, Any], owner: str, key_label: str, max_open: int) -> None:
        """Raises ``StoreLimitError`` when ``owner`` has ``max_open`` batches that have not ended."""
        ...

    async def get_batch(self, batch_id: str, owner: str) -> dict[str, Any] | None: ...
    async def list_batches(self, owner: str, *, after: str | None, limit: int) -> list[dict[str, Any]]: ...
    async def cancel(self, batch_id: str, owner: str, now: int) -> dict[str, Any] | None:
        """Marks an open batch ``cancelling``; an ended one is left as it is. None: no such batch of ``owner``'s."""
        ...

    async def claim(self, holder: str, now: float, lease_seconds: float) -> Claim | None:
        """Takes the lease of the oldest open batch nobody holds (or whose holder let its lease run out)."""
        ...

    async def renew(self, batch_id: str, holder: str, now: float, lease_seconds: float) -> dict[str, Any] | None:
        """Extends the lease and returns the batch as stored; None: the lease was lost."""
        ...

    async def release(self, batch_id: str, holder: str) -> None: ...
    async def update(self, batch: dict[str, Any], holder: str) -> bool:
        """Writes the batch's new status and times, if ``holder`` still holds it, it has not ended, and no cancel
        came in meanwhile."""
        ...

    async def add_result(self, batch_id: str, result: Result) -> bool:
        """Records one request's result, unless that line has one already; True when this one was kept."""
        ...

    async def done_lines(self, batch_id: str) -> set[int]: ...
    async def results(self, batch_id: str) -> list[Result]: ...
    async def finish(
        self, batch: dict[str, Any], holder: str, files: list[tuple[dict[str, Any], bytes]], owner: str
    ) -> bool:
        """Ends the batch with its result files at once; False (nothing written) if ``holder`` lost it."""
        ...

    async def count_by_status(self) -> dict[str, int]: ...


def default_sqlite_path() -> Path:
    """``batches.sqlite3`` in the gateway's local state folder (``gateway.local_state``)."""
    return local_state_dir() / SQLITE_FILE_NAME


def open_batch_store(config: BatchesConfig, shared: Redis | None) -> BatchStore:
    """``sqlite`` (the default file), ``sqlite://PATH``, or ``state_store`` (the Redis/Valkey of
    ``server.stores.state_store``, ``shared``, with file contents in ``config.files_dir``)."""
    if config.store == STATE_STORE:
        from gateway.batches.redis_store import RedisBatchStore

        if shared is None or config.files_dir is None:
            raise ValueError("batches.store: state_store needs server.stores.state_store and batches.files_dir")
        return RedisBatchStore(shared, Path(config.files_dir), max_stored_bytes=config.max_stored_bytes)
    from gateway.batches.sqlite_store import SQLiteBatchStore

    path = default_sqlite_path() if config.store == "sqlite" else Path(config.store.removeprefix("sqlite://"))
    return SQLiteBatchStore(path.expanduser(), max_stored_bytes=config.max_stored_bytes)

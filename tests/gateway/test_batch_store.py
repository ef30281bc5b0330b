"""The batch stores' rules, on each store (an SQLite file; a real Valkey with a files folder): one result per line,
leases that run out and are taken over, a holder that lost its lease writes nothing, a cancel wins over a runner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.batches.config import BatchesConfig
from gateway.batches.records import batch_object, file_object
from gateway.batches.store import BatchStore, Result, StoreLimitError, open_batch_store

from ..valkey import ValkeyServer

OWNER, OTHER = "name:team-a", "name:team-b"
LEASE = 30.0
T0 = 1_000_000.0
"""The clock at the start of each scenario (a lease nobody took ends at 0)."""


@pytest.fixture(params=["sqlite", "valkey"])
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[BatchesConfig, str | None]]:
    if request.param == "sqlite":
        yield BatchesConfig(store=f"sqlite://{tmp_path / 'batches.sqlite3'}", max_stored_bytes=4096), None
        return
    valkey = ValkeyServer(tmp_path)
    valkey.start()
    try:
        yield BatchesConfig(store="state_store", files_dir=str(tmp_path / "files"), max_stored_bytes=4096), valkey.url
    finally:
        valkey.kill()


def _run(config: tuple[BatchesConfig, str | None], scenario: Any) -> None:
    """Runs ``scenario(store)`` on a store opened as the gateway opens it, in one event loop."""

    async def main() -> None:
        batches, url = config
        client = None
        if url is not None:
            from redis.asyncio import Redis

            client = Redis.from_url(url)
        store = open_batch_store(batches, client)
        try:
            await scenario(store)
        finally:
            await store.close()
            if client is not None:
                await client.aclose()

    asyncio.run(main())


async def _open_batch(store: BatchStore, owner: str = OWNER, created_at: int = 1000) -> dict[str, Any]:
    file = file_object(
        f"file-{created_at}", size=3, created_at=created_at, filename="in.jsonl", purpose="batch", expires_at=None
    )
    await store.add_file(file, owner, b"{}\n")
    batch = batch_object(
        f"batch_{created_at}",
        endpoint="/v1/completions",
        input_file_id=file["id"],
        completion_window="24h",
        created_at=created_at,
        metadata=None,
    )
    await store.add_batch(batch, owner, "team", max_open=4)
    return batch


def test_a_line_keeps_its_first_result(store_config: tuple[BatchesConfig, str | None]) -> None:
    async def scenario(store: BatchStore) -> None:
        batch = await _open_batch(store)
        first = Result(1, True, 5, {"custom_id": "a", "attempt": 1})
        again = Result(1, False, 0, {"custom_id": "a", "attempt": 2})
        assert await store.add_result(batch["id"], first)
        assert not await store.add_result(batch["id"], again)
        assert await store.results(batch["id"]) == [first]
        assert await store.done_lines(batch["id"]) == {1}
        stored = await store.get_batch(batch["id"], OWNER)
        assert stored is not None and stored["request_counts"]["completed"] == 1

    _run(store_config, scenario)


def test_a_lease_is_taken_over_only_once_it_ran_out_and_its_old_holder_writes_nothing(
    store_config: tuple[BatchesConfig, str | None],
) -> None:
    async def scenario(store: BatchStore) -> None:
        batch = await _open_batch(store)
        claimed = await store.claim("a", now=T0, lease_seconds=LEASE)
        assert claimed is not None and claimed.batch["id"] == batch["id"] and claimed.owner == OWNER
        assert await store.claim("b", now=T0 + LEASE - 1, lease_seconds=LEASE) is None  # a still holds it
        assert await store.renew(batch["id"], "a", now=T0 + LEASE - 1, lease_seconds=LEASE) is not None
        assert await store.claim("b", now=T0 + 2 * LEASE - 2, lease_seconds=LEASE) is None  # renewed: still a's
        taken = await store.claim("b", now=T0 + 2 * LEASE, lease_seconds=LEASE)  # a went silent: b takes it over
        assert taken is not None and taken.batch["id"] == batch["id"]

        assert await store.renew(batch["id"], "a", now=T0 + 2 * LEASE, lease_seconds=LEASE) is None
        claimed.batch["status"] = "in_progress"
        assert not await store.update(claimed.batch, "a")
        ended = {**claimed.batch, "status": "completed"}
        output = file_object(
            "file-out", size=2, created_at=1, filename="o.jsonl", purpose="batch_output", expires_at=None
        )
        assert not await store.finish(ended, "a", [(output, b"x\n")], OWNER)
        assert await store.get_file("file-out", OWNER, now=0.0) is None

        assert await store.finish({**taken.batch, "status": "completed"}, "b", [(output, b"x\n")], OWNER)
        late = Result(1, True, 1, {"custom_id": "late"})  # a's request, ending after the batch did
        assert not await store.add_result(batch["id"], late)
        assert await store.file_content("file-out", OWNER, now=0.0) == b"x\n"
        assert await store.claim("c", now=T0 + 10 * LEASE, lease_seconds=LEASE) is None  # ended: nobody runs it
        assert (await store.count_by_status()).get("completed") == 1

    _run(store_config, scenario)


def test_a_cancel_wins_over_the_runner_and_another_owner_sees_nothing(
    store_config: tuple[BatchesConfig, str | None],
) -> None:
    async def scenario(store: BatchStore) -> None:
        batch = await _open_batch(store)
        claimed = await store.claim("a", now=T0, lease_seconds=LEASE)
        assert claimed is not None
        assert await store.cancel(batch["id"], OTHER, now=5) is None
        cancelled = await store.cancel(batch["id"], OWNER, now=5)
        assert cancelled is not None and cancelled["status"] == "cancelling"
        claimed.batch["status"] = "in_progress"
        assert not await store.update(claimed.batch, "a")  # the runner's late in_progress does not undo it
        renewed = await store.renew(batch["id"], "a", now=T0 + 1, lease_seconds=LEASE)
        assert renewed is not None and renewed["status"] == "cancelling"
        assert await store.get_batch(batch["id"], OTHER) is None
        assert await store.list_batches(OTHER, after=None, limit=10) == []
        assert await store.get_file(batch["input_file_id"], OTHER, now=0.0) is None
        assert not await store.delete_file(batch["input_file_id"], OTHER)

    _run(store_config, scenario)


def test_the_stored_bytes_bound_refuses_a_file_and_a_deleted_or_expired_file_frees_its_bytes(
    store_config: tuple[BatchesConfig, str | None],
) -> None:
    async def scenario(store: BatchStore) -> None:
        def file(name: str, expires_at: int | None = None) -> dict[str, Any]:
            return file_object(name, size=3000, created_at=1, filename="f", purpose="batch", expires_at=expires_at)

        await store.add_file(file("file-1", expires_at=100), OWNER, b"x" * 3000)
        with pytest.raises(StoreLimitError):
            await store.add_file(file("file-2"), OWNER, b"x" * 3000)
        assert await store.purge(now=50.0) == 0
        assert await store.purge(now=100.0) == 1
        await store.add_file(file("file-2"), OWNER, b"x" * 3000)
        assert await store.delete_file("file-2", OWNER)
        await store.add_file(file("file-3"), OWNER, b"x" * 3000)
        assert [
            f["id"] for f in await store.list_files(OWNER, 0.0, purpose=None, after=None, limit=10, descending=True)
        ] == ["file-3"]

    _run(store_config, scenario)

"""``RedisBatchStore``: batches, leases, results and file metadata in Redis/Valkey (``server.stores.state_store``), file
contents on a volume every replica mounts (``server.batches.files_dir``).

Redis holds what must change atomically across replicas: a batch's status and lease, each line's result (``HSETNX``:
one per line), the bytes stored; every change that must check something first is one Lua script. File contents
stay out of Redis (a batch's input can be 100 MiB): a file is written to the volume under a temporary name and
renamed before its metadata exists, so a file that is listed is whole. A batch's results live in Redis only while it
runs; its end writes the result files to the volume and then, in one script, their metadata, its status, and drops
its results.

Every key carries the hash tag ``{batches}``, so Redis Cluster runs each script on one slot.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gateway.batches.records import CANCELLING, ENDED_STATUSES, IN_PROGRESS, OPEN_STATUSES, VALIDATING
from gateway.batches.store import Claim, Result, StoreLimitError

if TYPE_CHECKING:
    from redis.asyncio import Redis

PREFIX = "{batches}:"
_SEQUENCE = PREFIX + "sequence"
_BYTES = PREFIX + "bytes"
_OPEN = PREFIX + "open"  # zset: open batch ids, oldest first
_STATUSES = PREFIX + "statuses"  # hash: status -> batches
_EXPIRING = PREFIX + "expiring"  # zset: file id -> expires_at


def _file(file_id: str) -> str:
    return f"{PREFIX}file:{file_id}"


def _files(owner: str) -> str:
    return f"{PREFIX}files:{owner}"


def _batch(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def _batches(owner: str) -> str:
    return f"{PREFIX}batches:{owner}"


def _owner_open(owner: str) -> str:
    return f"{PREFIX}open:{owner}"


def _results(batch_id: str) -> str:
    return f"{PREFIX}results:{batch_id}"


def _counts(batch_id: str) -> str:
    return f"{PREFIX}counts:{batch_id}"


# KEYS: file, owner's files, bytes, sequence, expiring. ARGV: id, owner, object, size, max bytes, expires_at ('').
_ADD_FILE = """
local stored = tonumber(redis.call('GET', KEYS[3]) or '0')
if stored + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return stored end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'object', ARGV[3], 'bytes', ARGV[4], 'expires_at', ARGV[6])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[4])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[5], ARGV[6], ARGV[1]) end
return -1
"""

# KEYS: file, owner's files, bytes, expiring. ARGV: id, owner ('': any). Returns 1 when deleted.
_DELETE_FILE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner or (ARGV[2] ~= '' and owner ~= ARGV[2]) then return 0 end
redis.call('DECRBY', KEYS[3], redis.call('HGET', KEYS[1], 'bytes'))
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS: batch, owner's batches, owner's open, open, sequence, statuses.
# ARGV: id, owner, key label, object, status, max open. Returns -1 when added, else the open batches.
_ADD_BATCH = """
local open_now = redis.call('ZCARD', KEYS[3])
if open_now >= tonumber(ARGV[6]) then return open_now end
local sequence = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'key_label', ARGV[3], 'object', ARGV[4], 'status', ARGV[5],
  'holder', '', 'lease_until', 0)
redis.call('ZADD', KEYS[2], sequence, ARGV[1])
redis.call('ZADD', KEYS[3], sequence, ARGV[1])
redis.call('ZADD', KEYS[4], sequence, ARGV[1])
redis.call('HINCRBY', KEYS[6], ARGV[5], 1)
return -1
"""

# KEYS: open. ARGV: holder, now, lease until, batch key prefix. Returns the claimed id, or false.
_CLAIM = """
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[4] .. id
  if tonumber(redis.call('HGET', key, 'lease_until') or '0') < tonumber(ARGV[2]) then
    redis.call('HSET', key, 'holder', ARGV[1], 'lease_until', ARGV[3])
    return id
  end
end
return false
"""

# KEYS: batch. ARGV: holder, lease until. Returns 1 when renewed.
_RENEW = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', ARGV[2])
return 1
"""

# KEYS: batch. ARGV: holder.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then redis.call('HSET', KEYS[1], 'holder', '', 'lease_until', 0) end
return 0
"""

# KEYS: batch, statuses. ARGV: holder ('': the owner's cancel, no holder check), expected status ('': any open one),
#       new status, new object, ended statuses (space separated), refused when stored is cancelling (1/0).
_WRITE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
if string.find(' ' .. ARGV[5] .. ' ', ' ' .. status .. ' ', 1, true) then return 0 end
if ARGV[2] ~= '' and status ~= ARGV[2] then return 0 end
if ARGV[6] == '1' and status == 'cancelling' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'object', ARGV[4])
if status ~= ARGV[3] then
  redis.call('HINCRBY', KEYS[2], status, -1)
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
return 1
"""

# KEYS: results, counts, batch. ARGV: line, result, ok (1/0), ended statuses. Returns 1 when kept.
_ADD_RESULT = """
local status = redis.call('HGET', KEYS[3], 'status')
if not status or string.find(' ' .. ARGV[4] .. ' ', ' ' .. status .. ' ', 1, true) then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3] == '1' and 'completed' or 'failed', 1)
return 1
"""

# KEYS: batch, statuses, open, owner's open, results, owner's files, bytes, sequence, expiring.
# ARGV: holder, new status, new object, ended statuses, batch id, file prefix, then per file: id, object, size,
#       expires_at (''). Returns 1 when written.
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
if string.find(' ' .. ARGV[4] .. ' ', ' ' .. status .. ' ', 1, true) then return 0 end
local owner = redis.call('HGET', KEYS[1], 'owner')
for i = 7, #ARGV, 4 do
  local id = ARGV[i]
  redis.call('HSET', ARGV[6] .. id, 'owner', owner, 'object', ARGV[i + 1], 'bytes', ARGV[i + 2],
    'expires_at', ARGV[i + 3])
  redis.call('ZADD', KEYS[6], redis.call('INCR', KEYS[8]), id)
  redis.call('INCRBY', KEYS[7], ARGV[i + 2])
  if ARGV[i + 3] ~= '' then redis.call('ZADD', KEYS[9], ARGV[i + 3], id) end
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'object', ARGV[3], 'holder', '', 'lease_until', 0)
redis.call('HINCRBY', KEYS[2], status, -1)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('ZREM', KEYS[3], ARGV[5])
redis.call('ZREM', KEYS[4], ARGV[5])
redis.call('DEL', KEYS[5])
return 1
"""

_ENDED = " ".join(ENDED_STATUSES)


class RedisBatchStore:
    """The batch store in Redis/Valkey, with file contents in ``files_dir``."""

    def __init__(self, client: Redis, files_dir: Path, *, max_stored_bytes: int) -> None:
        # Any: redis-py types replies as bytes or str by decode_responses; the state store's client answers bytes
        self._client: Any = client
        self.files_dir = files_dir
        self._max_stored_bytes = max_stored_bytes
        self._scripts = {
            name: client.register_script(source)
            for name, source in (
                ("add_file", _ADD_FILE),
                ("delete_file", _DELETE_FILE),
                ("add_batch", _ADD_BATCH),
                ("claim", _CLAIM),
                ("renew", _RENEW),
                ("release", _RELEASE),
                ("write", _WRITE),
                ("add_result", _ADD_RESULT),
                ("finish", _FINISH),
            )
        }

    def exists(self) -> bool:
        return True

    async def close(self) -> None:
        return None  # the client is the state store's, closed with it

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[name](keys=keys, args=args)

    # file contents on the volume

    def _path(self, file_id: str) -> Path:
        return self.files_dir / file_id  # ids are ours (file- and 24 hex digits), never a client's text

    def _write_content(self, file_id: str, content: bytes) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        partial = self.files_dir / f".{file_id}.{os.getpid()}.partial"
        partial.write_bytes(content)
        os.replace(partial, self._path(file_id))

    def _unlink(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)

    # files

    async def add_file(self, file: dict[str, Any], owner: str, content: bytes) -> None:
        await asyncio.to_thread(self._write_content, file["id"], content)
        expires = "" if file["expires_at"] is None else str(file["expires_at"])
        stored = await self._run(
            "add_file",
            [_file(file["id"]), _files(owner), _BYTES, _SEQUENCE, _EXPIRING],
            [file["id"], owner, orjson.dumps(file), len(content), self._max_stored_bytes, expires],
        )
        if int(stored) >= 0:
            await asyncio.to_thread(self._unlink, file["id"])
            raise StoreLimitError(
                f"The file store is full ({int(stored)} of {self._max_stored_bytes} bytes): delete files you no "
                "longer need, or wait for old ones to expire.",
                "storage_limit_exceeded",
            )

    async def _file_record(self, file_id: str, owner: str, now: float) -> dict[bytes, bytes] | None:
        record: dict[bytes, bytes] = await self._client.hgetall(_file(file_id))
        if not record or record[b"owner"].decode() != owner:
            return None
        expires = record[b"expires_at"]
        if expires and float(expires) <= now:
            return None
        return record

    async def get_file(self, file_id: str, owner: str, now: float) -> dict[str, Any] | None:
        record = await self._file_record(file_id, owner, now)
        return orjson.loads(record[b"object"]) if record is not None else None

    async def file_content(self, file_id: str, owner: str, now: float) -> bytes | None:
        if await self._file_record(file_id, owner, now) is None:
            return None
        try:
            return await asyncio.to_thread(self._path(file_id).read_bytes)
        except FileNotFoundError:
            return None

    async def list_files(
        self, owner: str, now: float, *, purpose: str | None, after: str | None, limit: int, descending: bool
    ) -> list[dict[str, Any]]:
        ids = [raw.decode() for raw in await self._client.zrange(_files(owner), 0, -1)]
        if descending:
            ids.reverse()
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        found: list[dict[str, Any]] = []
        for start in range(0, len(ids), 256):
            pipe = self._client.pipeline(transaction=False)
            for file_id in ids[start : start + 256]:
                pipe.hmget(_file(file_id), ["object", "expires_at"])
            for values in await pipe.execute():
                if values[0] is None or (values[1] and float(values[1]) <= now):
                    continue
                file = orjson.loads(values[0])
                if purpose is None or file["purpose"] == purpose:
                    found.append(file)
                    if len(found) >= limit:
                        return found
        return found

    async def delete_file(self, file_id: str, owner: str) -> bool:
        deleted = await self._run("delete_file", [_file(file_id), _files(owner), _BYTES, _EXPIRING], [file_id, owner])
        if deleted:
            await asyncio.to_thread(self._unlink, file_id)
        return bool(deleted)

    async def purge(self, now: float) -> int:
        purged = 0
        for raw in await self._client.zrangebyscore(_EXPIRING, "-inf", now):
            file_id = raw.decode()
            owner = await self._client.hget(_file(file_id), "owner")
            if owner is None:
                await self._client.zrem(_EXPIRING, file_id)
                continue
            if await self._run(
                "delete_file", [_file(file_id), _files(owner.decode()), _BYTES, _EXPIRING], [file_id, ""]
            ):
                await asyncio.to_thread(self._unlink, file_id)
                purged += 1
        return purged

    # batches

    async def add_batch(self, batch: dict[str, Any], owner: str, key_label: str, max_open: int) -> None:
        open_now = await self._run(
            "add_batch",
            [_batch(batch["id"]), _batches(owner), _owner_open(owner), _OPEN, _SEQUENCE, _STATUSES],
            [batch["id"], owner, key_label, orjson.dumps(batch), batch["status"], max_open],
        )
        if int(open_now) >= 0:
            raise StoreLimitError(
                f"You have {int(open_now)} batches that have not ended, the most allowed: wait for one to end or "
                "cancel one.",
                "batch_limit_exceeded",
            )

    async def _with_counts(self, batch: dict[str, Any]) -> dict[str, Any]:
        if batch["status"] in ENDED_STATUSES:  # its object holds the final counts
            return batch
        counts = await self._client.hgetall(_counts(batch["id"]))
        if counts:
            batch["request_counts"]["completed"] = int(counts.get(b"completed", 0))
            batch["request_counts"]["failed"] = int(counts.get(b"failed", 0))
        return batch

    async def _stored(self, batch_id: str) -> tuple[dict[str, Any], str, str] | None:
        """The batch, its owner and its key label."""
        values = await self._client.hmget(_batch(batch_id), ["object", "owner", "key_label"])
        if values[0] is None:
            return None
        return await self._with_counts(orjson.loads(values[0])), values[1].decode(), values[2].decode()

    async def get_batch(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        stored = await self._stored(batch_id)
        return stored[0] if stored is not None and stored[1] == owner else None

    async def list_batches(self, owner: str, *, after: str | None, limit: int) -> list[dict[str, Any]]:
        ids = [raw.decode() for raw in await self._client.zrevrange(_batches(owner), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        found = []
        for batch_id in ids[:limit]:
            batch = await self.get_batch(batch_id, owner)
            if batch is not None:
                found.append(batch)
        return found

    async def cancel(self, batch_id: str, owner: str, now: int) -> dict[str, Any] | None:
        while True:
            batch = await self.get_batch(batch_id, owner)
            if batch is None or batch["status"] not in (VALIDATING, IN_PROGRESS):
                return batch
            expected = batch["status"]
            batch["status"], batch["cancelling_at"] = CANCELLING, now
            if await self._write(batch, holder="", expected=expected, refuse_cancelling=False):
                return batch  # else it changed meanwhile: look again

    async def _write(self, batch: dict[str, Any], *, holder: str, expected: str, refuse_cancelling: bool) -> bool:
        return bool(
            await self._run(
                "write",
                [_batch(batch["id"]), _STATUSES],
                [holder, expected, batch["status"], orjson.dumps(batch), _ENDED, "1" if refuse_cancelling else "0"],
            )
        )

    async def claim(self, holder: str, now: float, lease_seconds: float) -> Claim | None:
        claimed = await self._run("claim", [_OPEN], [holder, now, now + lease_seconds, PREFIX + "batch:"])
        if not claimed:
            return None
        stored = await self._stored(claimed.decode())
        if stored is None:
            return None
        return Claim(*stored)

    async def renew(self, batch_id: str, holder: str, now: float, lease_seconds: float) -> dict[str, Any] | None:
        if not await self._run("renew", [_batch(batch_id)], [holder, now + lease_seconds]):
            return None
        stored = await self._stored(batch_id)
        return stored[0] if stored is not None else None

    async def release(self, batch_id: str, holder: str) -> None:
        await self._run("release", [_batch(batch_id)], [holder])

    async def update(self, batch: dict[str, Any], holder: str) -> bool:
        return await self._write(batch, holder=holder, expected="", refuse_cancelling=batch["status"] != CANCELLING)

    async def add_result(self, batch_id: str, result: Result) -> bool:
        blob = orjson.dumps({"ok": result.ok, "tokens": result.tokens, "result": result.result})
        kept = await self._run(
            "add_result",
            [_results(batch_id), _counts(batch_id), _batch(batch_id)],
            [result.line, blob, "1" if result.ok else "0", _ENDED],
        )
        return bool(kept)

    async def done_lines(self, batch_id: str) -> set[int]:
        return {int(line) for line in await self._client.hkeys(_results(batch_id))}

    async def results(self, batch_id: str) -> list[Result]:
        found = await self._client.hgetall(_results(batch_id))
        results = []
        for line, blob in found.items():
            record = orjson.loads(blob)
            results.append(Result(int(line), record["ok"], record["tokens"], record["result"]))
        results.sort(key=lambda result: result.line)
        return results

    async def finish(
        self, batch: dict[str, Any], holder: str, files: list[tuple[dict[str, Any], bytes]], owner: str
    ) -> bool:
        for file, content in files:  # the contents first: a file whose metadata exists is whole
            await asyncio.to_thread(self._write_content, file["id"], content)
        args: list[Any] = [holder, batch["status"], orjson.dumps(batch), _ENDED, batch["id"], PREFIX + "file:"]
        for file, content in files:
            args += [
                file["id"],
                orjson.dumps(file),
                len(content),
                "" if file["expires_at"] is None else file["expires_at"],
            ]
        keys = [
            _batch(batch["id"]),
            _STATUSES,
            _OPEN,
            _owner_open(owner),
            _results(batch["id"]),
            _files(owner),
            _BYTES,
            _SEQUENCE,
            _EXPIRING,
        ]
        if await self._run("finish", keys, args):
            await self._client.delete(_counts(batch["id"]))
            return True
        for file, _ in files:  # another process ended it: its files are the batch's, not these
            await asyncio.to_thread(self._unlink, file["id"])
        return False

    async def count_by_status(self) -> dict[str, int]:
        counts = await self._client.hgetall(_STATUSES)
        return {status.decode(): int(count) for status, count in counts.items() if status.decode() in _KNOWN}


_KNOWN = frozenset((*OPEN_STATUSES, *ENDED_STATUSES))

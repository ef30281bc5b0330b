"""``RedisResponseStore``: stored responses in Redis or Valkey, shared by every gateway process and replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import orjson

from gateway.responses.records import (
    DEFAULT_MAX_BYTES,
    Clock,
    ResponseStoreError,
    StoredResponse,
    serialized,
    worth_serializing_off_loop,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.typing import EncodableT

T = TypeVar("T")


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
    (``responses_store: redis://...``) keeps them from ever crowding out the budgets of ``server.stores.state_store``;
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

        self._failures: tuple[type[BaseException], ...] = (TimeoutError, OSError, RedisError)
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
        except self._failures as exc:
            raise ResponseStoreError(f"The response store failed: {exc}") from exc

    def keys_of(self, response_id: str) -> list[str]:
        """The keys one put or delete of ``response_id`` touches (all of one Redis Cluster slot)."""
        return [self._records + response_id, *self._index]

    async def put(self, record: StoredResponse) -> int:
        blob = await asyncio.to_thread(serialized, record) if worth_serializing_off_loop(record) else serialized(record)
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
        args: list[EncodableT] = [
            record.id,
            value,
            blob.size,
            repr(record.created_at),
            self._max_bytes,
            ttl,
            oldest,
            self._records,
        ]
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

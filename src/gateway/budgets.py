"""Token buckets that refill over a minute, kept in this process or in Redis so that replicas share them.

A take is all-or-nothing over several buckets (a key's request bucket and its token bucket): either every
bucket holds what the take requires and each gives its amount, or none changes. That is what makes a budget
exact across processes: with Redis, one Lua script does the refill, the check and the take atomically, on the
server's clock, so every replica sees the same levels. A key's buckets share one hash tag (``bucket_key``), so the
script's keys are in one Redis Cluster slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

WINDOW_SECONDS = 60.0
"""A bucket refills its whole capacity in this time (the limits are per minute)."""

Clock = Callable[[], float]


class Draw(NamedTuple):
    """What one bucket of a take needs: its key, capacity, the level it must hold, and what it gives."""

    key: str
    capacity: float
    require: float
    amount: float


class Take(NamedTuple):
    granted: bool
    levels: tuple[float, ...]
    """Each bucket's level after the take (or, when refused, as it stands)."""


class BudgetStore(Protocol):
    """Where bucket levels live."""

    async def take(self, draws: Sequence[Draw]) -> Take: ...

    async def adjust(self, key: str, capacity: float, delta: float) -> None:
        """Adds ``delta`` (negative: charges more than was reserved) to a bucket, never above its capacity."""
        ...


def bucket_key(label: str, kind: str) -> str:
    """A key's bucket of ``kind`` (``requests``, ``tokens``). The label is the hash tag: a take over a key's
    buckets touches keys of one Redis Cluster slot (a multi-key script across slots fails with CROSSSLOT)."""
    return f"{{{label}}}:{kind}"


def seconds_until(level: float, require: float, capacity: float) -> float:
    return max(0.0, (require - level) * WINDOW_SECONDS / capacity)


@dataclass
class _Bucket:
    level: float
    updated: float

    def refill(self, capacity: float, now: float) -> None:
        self.level = min(capacity, self.level + max(0.0, now - self.updated) * capacity / WINDOW_SECONDS)
        self.updated = now


class LocalBudgets:
    """Buckets in this process. ``share`` scales every capacity, so N processes without a shared store each
    allow 1/N of a budget."""

    def __init__(self, clock: Clock, share: float = 1.0) -> None:
        self._clock = clock
        self.share = share
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, key: str, capacity: float, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(capacity, now)
        bucket.refill(capacity, now)
        return bucket

    async def take(self, draws: Sequence[Draw]) -> Take:
        now = self._clock()
        buckets = [self._bucket(d.key, d.capacity * self.share, now) for d in draws]
        granted = all(b.level >= min(d.require, d.capacity * self.share) for b, d in zip(buckets, draws, strict=True))
        if granted:
            for bucket, draw in zip(buckets, draws, strict=True):
                bucket.level -= draw.amount
        return Take(granted, tuple(b.level / self.share for b in buckets))

    async def adjust(self, key: str, capacity: float, delta: float) -> None:
        bucket = self._bucket(key, capacity * self.share, self._clock())
        bucket.level = min(capacity * self.share, bucket.level + delta)


# KEYS: one bucket hash per draw. ARGV: capacity, require, amount for each draw, in KEYS order, then the clock
# ('': the server's, so replicas with skewed clocks still agree), then the window.
_NOW = """
local now
if ARGV[#ARGV - 1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[#ARGV - 1])
end
"""
_TAKE_SCRIPT = (
    _NOW
    + """
local window = tonumber(ARGV[#ARGV])
local levels = {}
local granted = 1
for i, key in ipairs(KEYS) do
  local capacity = tonumber(ARGV[3 * i - 2])
  local require = tonumber(ARGV[3 * i - 1])
  local state = redis.call('HMGET', key, 'level', 'updated')
  local level = tonumber(state[1]) or capacity
  local updated = tonumber(state[2]) or now
  level = math.min(capacity, level + math.max(0, now - updated) * capacity / window)
  levels[i] = level
  if level < require then granted = 0 end
end
local out = {granted}
for i, key in ipairs(KEYS) do
  local level = levels[i]
  if granted == 1 then level = level - tonumber(ARGV[3 * i]) end
  redis.call('HSET', key, 'level', tostring(level), 'updated', tostring(now))
  redis.call('EXPIRE', key, math.ceil(2 * window))
  out[i + 1] = tostring(level)
end
return out
"""
)

# KEYS: the bucket. ARGV: capacity, delta, the clock ('': the server's), the window.
_ADJUST_SCRIPT = (
    _NOW
    + """
local capacity = tonumber(ARGV[1])
local window = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'level', 'updated')
local level = tonumber(state[1]) or capacity
local updated = tonumber(state[2]) or now
level = math.min(capacity, level + math.max(0, now - updated) * capacity / window + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'updated', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(2 * window))
return tostring(level)
"""
)


class RedisBudgets:
    """Buckets in Redis (or Valkey), shared by every process and replica that uses the same server. They refill
    on the server's clock, or on ``clock`` when one is given (every replica must then share it: tests)."""

    def __init__(self, client: object, prefix: str = "gateway:budget:", clock: Clock | None = None) -> None:
        from redis.asyncio import Redis

        assert isinstance(client, Redis)
        self._prefix = prefix
        self._clock = clock
        self._take = client.register_script(_TAKE_SCRIPT)
        self._adjust = client.register_script(_ADJUST_SCRIPT)

    def keys_of(self, draws: Sequence[Draw]) -> list[str]:
        return [self._prefix + d.key for d in draws]

    def _now(self) -> str:
        return repr(self._clock()) if self._clock is not None else ""

    async def take(self, draws: Sequence[Draw]) -> Take:
        args: list[float | str] = []
        for draw in draws:
            args += [draw.capacity, min(draw.require, draw.capacity), draw.amount]
        args += [self._now(), WINDOW_SECONDS]
        result = await self._take(keys=self.keys_of(draws), args=args)
        return Take(bool(int(result[0])), tuple(float(level) for level in result[1:]))

    async def adjust(self, key: str, capacity: float, delta: float) -> None:
        await self._adjust(keys=[self._prefix + key], args=[capacity, delta, self._now(), WINDOW_SECONDS])

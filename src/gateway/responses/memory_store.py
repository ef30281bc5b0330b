"""``MemoryResponseStore``: stored responses in this process only, for tests and single-process gateways."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

import orjson

from gateway.responses.records import DEFAULT_MAX_BYTES, NOT_KEPT, Clock, Serialized, StoredResponse, serialized


class _MemoryRecord(NamedTuple):
    owner: str
    created_at: float
    previous_response_id: str | None
    blob: Serialized


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
        blob = serialized(record)
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

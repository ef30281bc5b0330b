"""The stored-response record, its serialized form and the ``ResponseStore`` protocol every store kind implements.

Every response belongs to the tenant that created it (``gateway.auth.request_owner``): a store answers a read or
a delete only for that owner, so another tenant's id is exactly as unknown as an id that never existed. Each store
is bounded in bytes (``server.stores.responses_max_bytes``, counted as the serialized response plus its input items).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import orjson

from backends.errors import BackendError

Clock = Callable[[], float]
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


class Serialized(NamedTuple):
    """A record's bytes as a store keeps them; their size is what the byte bound counts."""

    response: bytes
    input_items: bytes

    @property
    def size(self) -> int:
        return len(self.response) + len(self.input_items)


def serialized(record: StoredResponse) -> Serialized:
    return Serialized(orjson.dumps(record.response), orjson.dumps(record.input_items))


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


def worth_serializing_off_loop(record: StoredResponse) -> bool:
    """A record worth serializing off the event loop (a long conversation's items)."""
    return sum(len(str(item.get("content", ""))) for item in record.input_items) > 256 * 1024

"""The connection to the shared state store (Redis or Valkey) and its health.

When the store fails, callers fall back to what this process knows on its own; the store is tried again after
``retry_seconds`` (on the next call, or by the background probe), so it comes back by itself once reachable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def redacted_url(url: str) -> str:
    """The store's address without credentials, for logs and ``/ready``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class SharedStateStore:
    """One pooled client for the store, with an up/down state driven by the outcome of each call."""

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], float],
        retry_seconds: float = 1.0,
        timeout_seconds: float = 0.5,
    ) -> None:
        # redis is imported here, not at module level: a gateway without a store never needs it
        from redis.asyncio import Redis
        from redis.exceptions import RedisError

        self.failures_raised: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        """What a store call raises when the store is down or unreachable (never a client's mistake)."""
        self.url = redacted_url(url)
        self.client = Redis.from_url(
            url,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            health_check_interval=0,
        )
        self._clock = clock
        self._retry_seconds = retry_seconds
        self._retry_at = 0.0
        self.up = True
        self.reason = ""
        self.failures = 0

    def usable(self) -> bool:
        """Up, or down long enough that the next call should try it again."""
        return self.up or self._clock() >= self._retry_at

    def succeeded(self) -> None:
        if not self.up:
            logger.info("state store %s is back", self.url)
        self.up = True
        self.reason = ""

    def failed(self, exc: BaseException) -> None:
        if self.up:
            logger.warning("state store %s failed, using local state until it is back: %s", self.url, exc)
        self.up = False
        self.failures += 1
        self.reason = f"{type(exc).__name__}: {exc}"[:200]
        self._retry_at = self._clock() + self._retry_seconds

    async def probe(self) -> bool:
        try:
            await self.client.ping()
        except self.failures_raised as exc:
            self.failed(exc)
            return False
        self.succeeded()
        return True

    async def watch(self) -> None:
        """Probes the store while it is down, so health and metrics recover even with no traffic."""
        while True:
            await self.probe() if not self.up else None
            await asyncio.sleep(self._retry_seconds)

    def readiness(self) -> dict[str, object]:
        return {"url": self.url, "up": self.up, "reason": self.reason or None}

    async def close(self) -> None:
        await self.client.aclose()

"""The pooled HTTP client of an LMDeploy backend: one session for requests (bounded, keep-alive, its connections
counted) and one for health probes (a fresh connection per probe, never taken from the requests' pool)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from backends.config import LMDeployBackendConfig


class CountingConnector(aiohttp.TCPConnector):
    """Counts the connections it opens (``gateway_lmdeploy_connections_created``). A ``TraceConfig`` would do it
    through the public API, but then aiohttp builds trace parameters and sends signals for every request."""

    def __init__(self, created: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._created = created

    async def _create_connection(self, *args: Any, **kwargs: Any) -> Any:
        connection = await super()._create_connection(*args, **kwargs)
        self._created()
        return connection


def request_session(config: LMDeployBackendConfig, created: Callable[[], None]) -> aiohttp.ClientSession:
    """The session requests go upstream on; ``created`` is called for every connection it opens."""
    connector = CountingConnector(
        created, limit=config.max_connections, limit_per_host=0, keepalive_timeout=config.keepalive_timeout
    )
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))


def probe_session() -> aiohttp.ClientSession:
    """The session of the ``/health`` probes: its connections close after each probe, so the requests' pool and
    its connection counter are the requests' alone."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), skip_auto_headers=("User-Agent",))

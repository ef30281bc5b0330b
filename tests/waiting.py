"""Waiting in tests for something another thread or process does: a condition to hold, a server to be ready.

These poll state the test cannot be told about (a server started in another thread or process, a counter a
background task moves); ``timeout`` is a safety bound against a hang, never a measurement, and a test asserts on
what the wait returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Whether ``predicate`` holds within ``timeout`` seconds, polled every ``interval`` from this thread."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


async def until(predicate: Callable[[], object], within: float = 30.0, interval: float = 0.02) -> bool:
    """``wait_until`` for a test whose subject runs on the test's own event loop: it polls, yielding to the loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return bool(predicate())


def answers(url: str, *, status: int = 200, timeout: float = 5.0) -> bool:
    """Whether a GET of ``url`` answers ``status`` now (False when nothing accepts the connection yet)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == status
    except httpx.TransportError:
        return False


def wait_ready(url: str, *, timeout: float = 180.0, alive: Callable[[], None] | None = None) -> bool:
    """Whether ``url`` (a gateway's ``/ready``, a node's ``/health``) answers 200 within ``timeout`` seconds.
    ``alive`` is called before each probe and raises when the process behind ``url`` has exited, so a server that
    died while starting fails the test at once, with its own words."""

    def ready() -> bool:
        if alive is not None:
            alive()
        return answers(url, timeout=2.0)

    return wait_until(ready, timeout=timeout, interval=0.1)

"""A request's time limits as the server's config states them, and the ``backends.deadlines.Deadline`` that
enforces them over the request's waits for its backend."""

from __future__ import annotations

from typing import NamedTuple

from backends.interface import Deadline


class Timeouts(NamedTuple):
    total: float | None  # seconds from arrival to the last token
    idle: float | None  # seconds between two events (the first token included)
    stall: float | None = None  # seconds one send to a streaming client may block before the stream is stopped


def deadline_of(timeouts: Timeouts | None) -> Deadline | None:
    """The deadline of a request that starts now, or None when it has no time limit."""
    if timeouts is None or not (timeouts.total or timeouts.idle):
        return None
    return Deadline(timeouts.total, timeouts.idle)

"""The dispatchers (gateway front-end processes) a rank serves, as the rank sees them: each one's requests, lease
and step credits, and the ROUTER options that keep them apart."""

from __future__ import annotations

from collections import deque

import zmq

from backends.workers import messages as m


class Dispatcher:
    """One dispatcher (a gateway front-end process) in front of this rank: its requests, its lease, its credits."""

    __slots__ = (
        "behind_since",
        "identity",
        "last_report",
        "last_seen",
        "live",
        "prefix",
        "prefixes",
        "queued",
        "sent",
        "taken",
    )

    def __init__(self, identity: bytes, prefix: str, now: float) -> None:
        self.identity = identity
        self.prefix = prefix  # engine request id = prefix + the dispatcher's id: front ends may reuse each other's ids
        self.live: set[str] = set()  # engine request ids
        self.queued = 0  # prompt tokens of its requests not yet prefilled
        self.last_seen = now
        self.last_report = now
        self.sent = 0  # ``seq`` of the last STEP message with outputs or errors sent to it
        self.taken = 0  # ``seq`` of the last one it has taken
        self.behind_since: float | None = None  # since when the rank waits for it to take its outputs
        self.prefixes: deque[bytes] = deque(maxlen=m.PREFIXES_PENDING)  # other dispatchers' prompts, to pass on

    def take_prefixes(self) -> list[bytes]:
        prefixes = list(self.prefixes)
        self.prefixes.clear()
        return prefixes

    @property
    def behind(self) -> bool:
        """The rank may not step: this dispatcher's requests would get outputs past its ``STEPS_AHEAD`` credits."""
        return bool(self.live) and self.sent - self.taken >= m.STEPS_AHEAD


def route_to_dispatchers(socket: zmq.Socket) -> None:
    """The rank's ROUTER options, set before it binds: from the first connection on (its engine may still be
    building), a dispatcher reconnecting under its routing id takes the old connection's place."""
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue blocks (or times out), an unknown peer raises
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a dispatcher reconnecting under its id takes its place

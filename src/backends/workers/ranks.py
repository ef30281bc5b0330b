"""The dispatcher's view of each rank (state, load, counters, why it does not serve) and of the ranks' engine."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import zmq
from tokenizers import Tokenizer

from backends.engine.driver import DriverStats
from backends.workers import messages as m
from backends.workers.launch import RankProcess

if TYPE_CHECKING:
    from backends.workers.driver import DataParallelDriver

HELLO_AGAIN_SECONDS = 2.0
HELLO_AGAIN_MAX_SECONDS = 30.0
"""A remote rank that does not answer our hello is greeted again after 2 s, then 4, 8, ... up to every 30 s."""


class RankState:
    """The dispatcher's view of one rank; read by metrics and tests."""

    def __init__(self, index: int, endpoint: str, remote: bool) -> None:
        self.index = index
        self.endpoint = endpoint
        self.remote = remote
        self.state: Literal["down", "starting", "up"] = "down"
        self.process: RankProcess | None = None
        self.exited: asyncio.Future[int] | None = None
        self.socket: zmq.Socket | None = None
        self.pid: int | None = None
        self.info: m.EngineInfo | None = None
        self.requests: set[str] = set()
        self.queued_tokens = 0
        self.others = m.RankLoad(0, 0)  # what the rank holds for other dispatchers, as it last reported
        self.hellos = 0  # RESETs sent on this socket and not answered yet
        self.hello_at = 0.0  # when the last one was sent
        self.hello_again = HELLO_AGAIN_SECONDS  # a starting remote rank not answering is greeted again after this
        self.adds: list[list[Any]] = []
        self.aborts: list[str] = []
        self.taken = 0  # ``seq`` of the last STEP message taken: its outputs handed on, the tasks they woke run
        self.credited = 0  # the ``taken`` the rank was last told
        self.stats: m.RankStats | None = None  # the rank's own counters (this incarnation's), as last reported
        self.samples: Sequence[Sequence[Any]] = ()  # the engine's own metric_samples(), as last reported
        self.dispatched = 0  # requests this dispatcher sent it (the rank's own count, of everyone's: ``stats``)
        self.launches = 0  # launches (local ranks) or connections (remote ones) by this dispatcher
        self.launch = 0  # the incarnation's own number, as it reported it (READY, STARTING); 0: not heard yet
        self.after = ""  # why its previous incarnation ended, as it reported it
        self.reason = "not started"
        self.retry_at: float | None = None  # down: when it is started (or, remote, connected) again
        self.settled = False  # up once, or failed once: the backend's start waits for no more
        self.builds_at: float | None = None  # starting: when it said it would build its engine (after its backoff)
        self.last_heard = 0.0

    def explain(self, now: float) -> str:
        """Why the rank does not serve, with its restarts and backoff: for ``/ready`` and the log."""
        if self.state == "down" and self.retry_at is not None:
            text = f"{self.reason}; restarting in {max(0.0, self.retry_at - now):.1f} s"
        elif self.state == "starting" and self.launch:
            text = f"starting, launch {self.launch}"
            if self.builds_at is not None and self.builds_at > now:
                text += f", building its engine in {self.builds_at - now:.1f} s"
            if self.after:
                text += f" (after: {self.after})"
        else:
            text = self.reason
        return f"{text}; {self.restarts} restarts" if self.restarts else text

    def backoff(self, now: float) -> float:
        """Seconds until the rank is started again (0 when it is up or starting now)."""
        if self.state == "down" and self.retry_at is not None:
            return max(0.0, self.retry_at - now)
        if self.state == "starting" and self.builds_at is not None:
            return max(0.0, self.builds_at - now)
        return 0.0

    def report(self, stats: m.RankStats) -> None:
        self.stats = stats
        if stats.samples is not None:  # sent about once a second, not with every step
            self.samples = stats.samples

    @property
    def outstanding(self) -> int:
        return len(self.requests)

    @property
    def has_commands(self) -> bool:
        """Adds, aborts or a credit wait to be sent (held back by a full queue, or not flushed yet)."""
        return bool(self.adds or self.aborts) or self.taken != self.credited

    @property
    def restarts(self) -> int:
        """As the rank's launcher counts them: the incarnation number a remote rank reports, our launches of a local
        one (which tell it its number)."""
        return max(0, (self.launch if self.remote else self.launches) - 1)

    def totals(self) -> DriverStats:
        """The rank's counters since it started, as it reported them (the same for every dispatcher)."""
        s = self.stats
        if s is None:
            return DriverStats()
        return DriverStats(s.steps, s.tokens, s.busy_seconds, s.engine_seconds)

    def forget_stats(self) -> None:
        """The rank is down: its counters and gauges are gone with it (a new incarnation counts from 0)."""
        self.stats = None
        self.samples = ()


class RankedEngineView:
    """What ``EngineBackend`` reads from ``driver.engine``: the tokenizer (loaded here) and the ranks' limits, as the
    first rank that came up reported them (until one has, the tokenizer's vocabulary and no context)."""

    def __init__(self, tokenizer: Tokenizer, driver: DataParallelDriver) -> None:
        self.tokenizer = tokenizer
        self._driver = driver

    @property
    def info(self) -> m.EngineInfo | None:
        return next((r.info for r in self._driver.ranks if r.info is not None), None)

    @property
    def max_model_len(self) -> int:
        info = self.info
        return info.max_model_len if info is not None else 0

    @property
    def vocab_size(self) -> int:
        info = self.info
        return info.vocab_size if info is not None else self.tokenizer.get_vocab_size()

    @property
    def fingerprint(self) -> str | None:
        info = self.info
        return info.fingerprint if info is not None else None

    def get_num_unfinished_requests(self) -> int:
        """Requests some rank still holds, as the dispatcher knows them."""
        return self._driver.in_flight

    def metric_samples(self) -> tuple[()]:
        return ()  # per-rank statistics are metric families with a rank label (``DataParallelBackend``)

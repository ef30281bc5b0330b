"""What a rank process is told when it starts (``WorkerSpec``, one JSON argument), and what the engine factory it
names is told (``RankContext``) and returns (``RankEngine``)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from backends.engine.protocol import Engine
from backends.workers.collective import DataParallelGroup

DISPATCHER_LEASE_SECONDS = 10.0
"""A dispatcher (it pings every second) silent this long, or not reading for this long, is taken for gone: its
requests are aborted so that a killed front end does not leave its requests running on the ranks."""


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker process needs, passed as one JSON argument."""

    rank: int
    size: int
    endpoint: str  # the worker binds here; the dispatcher connects
    factory: str  # "module:function" returning a RankEngine for a RankContext
    options: dict[str, Any] = field(default_factory=dict)  # the factory's own configuration (JSON)
    lockstep: bool = False
    collective_endpoint: str | None = None  # lockstep: where rank 0 hosts the group's rendezvous
    parent_pid: int | None = None  # exit with the gateway that started us (None: started by someone else)
    lease_seconds: float = DISPATCHER_LEASE_SECONDS  # a dispatcher silent this long loses its requests
    launch: int = 1  # this incarnation's number, as the launcher counts (restarts + 1)
    after: str = ""  # why the previous incarnation ended
    start_delay: float = 0.0  # the restart backoff, waited (answering dispatchers) before the engine is built
    failure_fd: int | None = None  # a pipe to the launcher: why the engine failed, written before exiting
    keys: str | None = None  # rank_keys: over TCP only dispatchers with an admitted key are heard (CURVE)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class RankContext:
    """What an engine factory is told about the rank it builds."""

    rank: int
    size: int
    lockstep: bool
    collective_endpoint: str | None
    options: dict[str, Any]


class RankEngine(NamedTuple):
    """A factory's product: the engine, and in lockstep mode the group the ranks use to agree on stopping."""

    engine: Engine
    group: DataParallelGroup | None = None


RankEngineFactory = Callable[[RankContext], RankEngine]


def load_factory(path: str) -> RankEngineFactory:
    module, _, name = path.partition(":")
    factory = getattr(importlib.import_module(module), name)
    return factory

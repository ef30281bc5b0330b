"""TEST DOUBLE of ``torch.distributed`` for DeepInfer DP ranks on CPU: collectives that check their lockstep.

One process is one rank. ``init_process_group`` meets the group at the ``tcp://host:port`` init method (rank 0
hosts the hub, as torch's TCPStore lives on rank 0) and every collective is a MAX all-reduce through that hub,
the gateway's own ``SimulatedGroup`` (``backends.workers.collective``). Unlike gloo, each collective is
**labelled by the function that called it** (``LLMEngine.step``, ``LLMEngine.has_unfinished_requests``, ...): when
the ranks are not all in the same call of the same round, every rank gets a ``CollectiveError`` at once, so a
lockstep mistake fails loudly instead of mixing two collectives or hanging. A rank that never arrives makes the
others fail after ``DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT`` seconds (default 60; gloo has such a timeout too).
"""

from __future__ import annotations

import enum
import os
import sys
from typing import Any

from backends.workers.collective import SimulatedGroup


class ReduceOp(enum.Enum):
    MAX = "max"


class ProcessGroup:
    """A group of ranks; in the double every group is the whole simulated world (one process per DP rank)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def size(self) -> int:
        return len(self.ranks)


_world: SimulatedGroup | None = None


def is_initialized() -> bool:
    return _world is not None


def init_process_group(backend: str, *, world_size: int, rank: int, init_method: str, timeout: Any = None) -> None:
    """Blocks until every rank arrived, as torch's rendezvous does."""
    global _world
    if _world is not None:
        raise RuntimeError("trying to initialize the default process group twice!")
    if not init_method.startswith("tcp://"):
        raise ValueError(f"the torch test double rendezvous only over tcp://, not {init_method!r}")
    seconds = float(os.environ.get("DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT", "60"))
    _world = SimulatedGroup(rank, world_size, init_method, timeout=seconds)
    _collective(0, "init_process_group")


def new_group(ranks: list[int], backend: str | None = None) -> ProcessGroup:
    if _world is None or sorted(ranks) != list(range(_world.size)):
        raise RuntimeError("the torch test double supports only groups of the whole world")
    return ProcessGroup(ranks)


def get_rank(group: ProcessGroup | None = None) -> int:
    return _require().rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    return _require().size


def all_reduce(tensor: Any, op: ReduceOp = ReduceOp.MAX, group: ProcessGroup | None = None) -> None:
    if op is not ReduceOp.MAX:
        raise NotImplementedError("the torch test double reduces with MAX only")
    label = f"all_reduce from {_caller()}"
    tensor.values = [_collective(int(v), label) for v in tensor.values]


def barrier(group: ProcessGroup | None = None) -> None:
    _collective(0, f"barrier from {_caller()}")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """In the double a final collective (labelled ``close``, which lets rank 0's hub exit after every peer)."""
    global _world
    world = _require()
    world.all_reduce_max(0, "close")
    world.close()
    _world = None


def _require() -> SimulatedGroup:
    if _world is None:
        raise RuntimeError("Default process group has not been initialized, please call init_process_group")
    return _world


def _collective(value: int, label: str) -> int:
    return _require().all_reduce_max(value, label)


def _caller() -> str:
    return sys._getframe(2).f_code.co_qualname

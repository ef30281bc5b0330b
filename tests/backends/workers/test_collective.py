"""The CPU imitation of DeepInfer's DP collectives: a MAX all-reduce that blocks until every rank arrives and
refuses ranks that are in different collectives, so lockstep slips fail the tests instead of passing by luck."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backends.workers.collective import CollectiveError, SimulatedGroup


def run_ranks(size: int, endpoint: str, calls: list[tuple[str, int]]) -> list[object]:
    """Each rank makes ``calls[rank]`` on its own thread; returns each rank's result or exception."""
    results: list[object] = [None] * size
    groups: list[SimulatedGroup] = []
    for rank in range(size):
        groups.append(SimulatedGroup(rank, size, endpoint, timeout=10))

    def run(rank: int) -> None:
        op, value = calls[rank]
        try:
            results[rank] = groups[rank].all_reduce_max(value, op)
        except CollectiveError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for group in groups:
        group._socket.close()
    return results


def test_all_reduce_returns_the_maximum_to_every_rank(tmp_path: Path) -> None:
    results = run_ranks(3, f"ipc://{tmp_path}/hub", [("has_unfinished_requests", v) for v in (0, 1, 0)])
    assert results == [1, 1, 1]


def test_ranks_in_different_collectives_all_fail(tmp_path: Path) -> None:
    results = run_ranks(2, f"ipc://{tmp_path}/hub", [("step", 0), ("has_unfinished_requests", 1)])
    assert all(isinstance(r, CollectiveError) for r in results)
    assert "different collectives" in str(results[0])


def test_a_missing_rank_is_a_timeout_not_a_hang(tmp_path: Path) -> None:
    group = SimulatedGroup(0, 2, f"ipc://{tmp_path}/hub", timeout=0.2)
    with pytest.raises(CollectiveError, match="did not join"):
        group.all_reduce_max(1, "has_unfinished_requests")

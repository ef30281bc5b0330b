"""A rank's step message reaches each request's sink whole, in order, as ``EngineOutput`` records, once per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.engine.protocol import EngineOutput
from backends.errors import BackendError, UpstreamError
from backends.workers.driver import DataParallelDriver, _Entry
from backends.workers.launch import WorkerPlan
from backends.workers.ranks import RankState


def wire(request_id: str, token: int, finished: bool = False) -> tuple[Any, ...]:
    """One output as a rank sends it: ``EngineOutput`` fields in order, as msgpack gives them back (a tuple)."""
    return (request_id, token, finished, "length" if finished else "", token, 8, -0.5, (), (), None)


def driver_with(requests: Sequence[str]) -> tuple[DataParallelDriver, dict[str, list[Any]]]:
    driver = DataParallelDriver("test", WorkerPlan(1, "unused:factory"), lambda: None)  # type: ignore[arg-type,return-value]
    rank = RankState(0, "ipc://unused", remote=False)
    driver.ranks = [rank]
    received: dict[str, list[Any]] = {r: [] for r in requests}
    for request_id in requests:
        driver._sinks[request_id] = _Entry(lambda _, item, r=request_id: received[r].append(item), 0, 0, 8)
        rank.requests.add(request_id)
        rank.queued_tokens += 8
    return driver, received


def test_outputs_of_one_step_are_grouped_per_request_in_order_even_when_interleaved() -> None:
    driver, received = driver_with(["a", "b"])
    outputs = [wire("a", 10), wire("a", 11), wire("b", 20), wire("a", 12), wire("b", 21, finished=True)]
    driver._dispatch(driver.ranks[0], outputs, [])
    assert [[o.token_id for o in step] for step in received["a"]] == [[10, 11, 12]]  # one sink call per step
    assert [[o.token_id for o in step] for step in received["b"]] == [[20, 21]]
    step = received["b"][0]
    assert all(type(o) is EngineOutput for o in step)
    assert step[-1].finished and step[-1].finish_reason == "length" and step[-1].prompt_logprobs is None
    assert "b" not in driver._sinks and "a" in driver._sinks  # the finished request is forgotten, the other kept
    assert driver.ranks[0].queued_tokens == 0  # both prefills are done


def test_late_outputs_of_an_aborted_request_are_dropped_and_errors_reach_their_request() -> None:
    driver, received = driver_with(["a", "b"])
    driver.abort(["a"])
    driver._dispatch(driver.ranks[0], [wire("a", 10)], [("b", "upstream", "the engine failed")])
    assert received["a"] == []
    (error,) = received["b"]
    assert isinstance(error, UpstreamError) and isinstance(error, BackendError)
    assert str(error) == "the engine failed"

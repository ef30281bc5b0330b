"""``EngineDriver`` (the gateway's engine thread) on DeepInfer's real engine, built by the binding."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from backends.engine.driver import EngineDriver
from backends.engine.protocol import EngineOutput
from backends.errors import BackendError

from .conftest import start


class Collector:
    """A driver sink: every output of one request, and an event set by its final output (or an error)."""

    def __init__(self) -> None:
        self.outputs: list[EngineOutput] = []
        self.error: BackendError | None = None
        self.done = asyncio.Event()
        self.first = asyncio.Event()

    def __call__(self, index: int, result: Sequence[EngineOutput] | BackendError) -> None:
        if isinstance(result, BackendError):
            self.error = result
            self.done.set()
            return
        self.outputs += result
        self.first.set()
        if result[-1].finished:
            self.done.set()


async def wait_idle(driver: EngineDriver) -> None:
    """Until the engine reports no work and the driver thread has gone back to waiting for commands."""
    engine = driver.engine
    assert engine is not None
    for _ in range(2000):
        steps = driver.stats.steps
        await asyncio.sleep(0.005)
        if driver.stats.steps == steps and engine.get_num_unfinished_requests() == 0:
            return
    raise AssertionError("the driver never went idle")


@pytest.mark.parametrize("zos", ["1", "0"], ids=["zos", "no-zos"])
async def test_driver_delivers_every_token_and_the_final_output(real_model_dir: Path, zos: str) -> None:
    driver = EngineDriver(lambda: start(real_model_dir, env={"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": zos}), name="d")
    await driver.start()
    engine = driver.engine
    assert engine is not None
    prompt = np.asarray(engine.tokenizer.encode("alpha beta gamma delta").ids, dtype=np.int32)
    sinks = {rid: Collector() for rid in ("a", "b")}
    for rid, sink in sinks.items():
        driver.add(rid, {"max_tokens": 64}, prompt, sink, 0)
    await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks.values())), 60)
    for sink in sinks.values():
        assert sink.error is None
        assert engine.tokenizer.decode([o.token_id for o in sink.outputs]) == "alpha beta gamma delta"
        expected = list(range(1, len(prompt) + 1))  # the prompt after BOS, then EOS
        assert [o.num_output_tokens for o in sink.outputs] == expected, "every token once, in order"
        assert (sink.outputs[-1].finished, sink.outputs[-1].finish_reason) == (True, "stop")
    assert driver.in_flight == 0
    await wait_idle(driver)
    await driver.stop()


async def test_driver_abort_frees_the_engine_slot(real_model_dir: Path) -> None:
    driver = EngineDriver(lambda: start(real_model_dir), name="d")
    await driver.start()
    engine = driver.engine
    assert engine is not None
    prompt = np.asarray(engine.tokenizer.encode("alpha").ids, dtype=np.int32)
    sink = Collector()
    driver.add("long", {"max_tokens": 200, "ignore_eos": True}, prompt, sink, 0)
    await asyncio.wait_for(sink.first.wait(), 30)
    driver.abort(["long"])
    await wait_idle(driver)
    assert not sink.done.is_set(), "an aborted request gets no further output"
    assert engine.statistics.aborted == 1
    assert driver.in_flight == 0
    await driver.stop()

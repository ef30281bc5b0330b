"""The reference engine's prefix cache: hits by whole blocks of a shared prefix, LRU within its bound, reported on
a request's first output and in its counters, and cached tokens skip the timing model's prefill time."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from backends.engine.protocol import EngineOutput
from backends.reference import ReferenceArtifacts, ReferenceEngine
from backends.reference import engine as engine_module
from backends.reference import timing as timing_module
from backends.reference.prefix_cache import PrefixCache

MakeEngine = Callable[..., ReferenceEngine]
BLOCK = 16


def prompt_of(length: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + length, dtype=np.int32)


def first_outputs(engine: ReferenceEngine) -> dict[str, EngineOutput]:
    """Steps until idle; each request's first output."""
    firsts: dict[str, EngineOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            firsts.setdefault(out.request_id, out)
    return firsts


def serve(engine: ReferenceEngine, request_id: str, prompt: np.ndarray) -> EngineOutput:
    engine.add_request("u", request_id, {"max_tokens": 2, "ignore_eos": True}, prompt)
    return first_outputs(engine)[request_id]


def test_a_repeated_prompt_hits_its_whole_blocks_but_never_its_last_token(make_engine: MakeEngine) -> None:
    engine = make_engine(prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    prompt = prompt_of(3 * BLOCK + 5)
    assert serve(engine, "cold", prompt).num_cached_tokens == 0
    assert serve(engine, "warm", prompt).num_cached_tokens == 3 * BLOCK
    exact = prompt_of(3 * BLOCK)  # the block holding the last token is computed again
    assert serve(engine, "exact", exact).num_cached_tokens == 2 * BLOCK
    assert engine.prefix_cache_hit_tokens == 5 * BLOCK
    assert engine.prefix_cache_queried_tokens == 2 * (3 * BLOCK + 5) + 3 * BLOCK


def test_a_prompt_extending_a_served_one_hits_the_shared_prefix_only(make_engine: MakeEngine) -> None:
    engine = make_engine(prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    first_turn = prompt_of(2 * BLOCK + 3)
    serve(engine, "turn1", first_turn)
    second_turn = np.concatenate([first_turn, prompt_of(40, start=5000)])
    assert serve(engine, "turn2", second_turn).num_cached_tokens == 2 * BLOCK
    diverging = second_turn.copy()
    diverging[BLOCK + 1] = 7  # a different token in the second block: only the first block is shared
    assert serve(engine, "other", diverging).num_cached_tokens == BLOCK


def test_requests_admitted_in_the_same_step_do_not_hit_each_other(make_engine: MakeEngine) -> None:
    engine = make_engine(prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    prompt = prompt_of(4 * BLOCK)
    for request_id in ("a", "b"):
        engine.add_request("u", request_id, {"max_tokens": 2, "ignore_eos": True}, prompt)
    firsts = first_outputs(engine)
    assert firsts["a"].num_cached_tokens == firsts["b"].num_cached_tokens == 0
    assert engine.prefix_cache_hit_tokens == 0


def test_later_outputs_and_engines_without_a_cache_report_no_hits(make_engine: MakeEngine) -> None:
    engine = make_engine(prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    prompt = prompt_of(2 * BLOCK + 1)
    serve(engine, "cold", prompt)
    engine.add_request("u", "warm", {"max_tokens": 4, "ignore_eos": True}, prompt)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.num_cached_tokens for o in outputs] == [2 * BLOCK, 0, 0, 0]

    plain = make_engine()
    serve(plain, "cold", prompt)
    assert serve(plain, "again", prompt).num_cached_tokens == 0
    assert plain.prefix_cache is None and plain.prefix_cache_hit_tokens == 0


def test_the_cache_keeps_its_bound_and_evicts_the_least_recently_used_prefix(make_engine: MakeEngine) -> None:
    engine = make_engine(prefix_cache_tokens=4 * BLOCK, prefix_cache_block_size=BLOCK)
    a, b, c = prompt_of(2 * BLOCK + 1, 100), prompt_of(2 * BLOCK + 1, 1000), prompt_of(2 * BLOCK + 1, 2000)
    serve(engine, "a", a)
    serve(engine, "b", b)
    assert serve(engine, "a again", a).num_cached_tokens == 2 * BLOCK  # a is now the most recent
    serve(engine, "c", c)  # evicts b, the least recently used
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 4
    assert serve(engine, "a third time", a).num_cached_tokens == 2 * BLOCK
    assert serve(engine, "b again", b).num_cached_tokens == 0


def test_eviction_takes_a_prefix_tail_before_its_head() -> None:
    cache = PrefixCache(block_size=2, capacity_blocks=3)
    long = cache.block_keys(prompt_of(7))  # three blocks
    cache.insert(long)
    cache.insert(cache.block_keys(prompt_of(3, start=900)))  # one block more: one of the long prompt's goes
    assert cache.lookup(long) == 4  # its head survives, its tail went


def test_cached_tokens_skip_the_timing_models_prefill_time(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    class StoppedClock:
        """The timing model's clock, stopped: each step's sleep is exactly the step's modelled duration."""

        def __init__(self) -> None:
            self.sleeps: list[float] = []

        def perf_counter(self) -> float:
            return 0.0

        def sleep(self, seconds: float) -> None:
            self.sleeps.append(seconds)

    clock = StoppedClock()
    monkeypatch.setattr(timing_module, "time", clock)
    monkeypatch.setattr(engine_module, "time", clock)  # where a step's start is read
    engine = make_engine(prefill_seconds_per_token=1.0, prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    prompt = prompt_of(3 * BLOCK + 5)
    engine.add_request("u", "cold", {"max_tokens": 1}, prompt)
    engine.step()
    engine.add_request("u", "warm", {"max_tokens": 1}, prompt)
    engine.step()
    assert clock.sleeps == [3 * BLOCK + 5, 5]


def test_prefix_cache_arguments_are_checked(make_engine: MakeEngine) -> None:
    with pytest.raises(ValueError):
        make_engine(prefix_cache_tokens=-1)
    with pytest.raises(ValueError):
        make_engine(prefix_cache_block_size=0)
    assert make_engine(prefix_cache_tokens=BLOCK - 1, prefix_cache_block_size=BLOCK).prefix_cache is None


def test_metric_samples_are_the_engines_counters(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine(prefix_cache_tokens=64 * BLOCK, prefix_cache_block_size=BLOCK)
    prompt = prompt_of(2 * BLOCK + 1)
    serve(engine, "cold", prompt)
    serve(engine, "warm", prompt)
    samples = {s.name: s.value for s in engine.metric_samples()}
    assert samples == {
        "engine_prefix_cache_queried_tokens": 2 * (2 * BLOCK + 1),
        "engine_prefix_cache_hit_tokens": 2 * BLOCK,
    }

"""The dispatcher's choice of rank: least work, prefix affinity priced against load, turns on ties."""

from __future__ import annotations

import numpy as np
import pytest

from backends.workers.balancer import RankBalancer

UP4 = [True, True, True, True]


def prompt(seed: int, length: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 8000, size=length, dtype=np.int32)


def test_least_loaded_rank_is_chosen() -> None:
    balancer = RankBalancer(4)
    assert balancer.choose(prompt(0), [3, 1, 0.5, 2], UP4) == 2


def test_equally_loaded_ranks_are_taken_in_turn() -> None:
    balancer = RankBalancer(4)
    chosen = [balancer.choose(prompt(i), [0, 0, 0, 0], UP4) for i in range(8)]
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_queued_prompt_tokens_count_as_work() -> None:
    balancer = RankBalancer(2, prefill_tokens_per_request=512)
    loads = [balancer.load(outstanding=1, queued_tokens=0), balancer.load(outstanding=0, queued_tokens=2048)]
    assert loads == [1.0, 4.0]
    assert balancer.choose(prompt(1), loads, [True, True]) == 0


def test_ranks_that_are_down_are_never_chosen() -> None:
    balancer = RankBalancer(3)
    chosen = {balancer.choose(prompt(i), [5, 0, 0], [True, False, False]) for i in range(5)}
    assert chosen == {0}
    with pytest.raises(LookupError):
        balancer.choose(prompt(9), [0, 0, 0], [False, False, False])


def test_long_shared_prefix_returns_to_the_rank_that_has_it() -> None:
    balancer = RankBalancer(4, block_tokens=64)
    system = prompt(42, 640)
    first = balancer.choose(np.concatenate([system, prompt(1)]), [0, 0, 0, 0], UP4)
    # Without affinity equal loads would rotate to the next rank; the shared 640 tokens keep it where it was.
    again = [balancer.choose(np.concatenate([system, prompt(i)]), [0, 0, 0, 0], UP4) for i in range(2, 6)]
    assert again == [first] * 4


def test_affinity_gives_way_to_a_rank_much_busier_than_the_hit_is_worth() -> None:
    balancer = RankBalancer(2, block_tokens=64, prefill_tokens_per_request=512)
    system = prompt(7, 640)  # worth 640 / 512 = 1.25 requests
    home = balancer.choose(np.concatenate([system, prompt(1)]), [0, 0], [True, True])
    other = 1 - home
    slightly_busier = [0.0, 0.0]
    slightly_busier[home] = 1.0
    assert balancer.choose(np.concatenate([system, prompt(2)]), slightly_busier, [True, True]) == home
    much_busier = [0.0, 0.0]
    much_busier[home] = 2.0
    assert balancer.choose(np.concatenate([system, prompt(3)]), much_busier, [True, True]) == other


def test_prefix_shorter_than_a_block_earns_no_affinity() -> None:
    balancer = RankBalancer(2, block_tokens=64)
    shared = prompt(5, 63)
    chosen = [balancer.choose(np.concatenate([shared, prompt(i, 8)]), [0, 0], [True, True]) for i in range(4)]
    assert chosen == [0, 1, 0, 1]


def test_a_restarted_rank_loses_its_prefixes() -> None:
    balancer = RankBalancer(2, block_tokens=64)
    system = prompt(11, 256)
    home = balancer.choose(np.concatenate([system, prompt(1)]), [0, 0], [True, True])
    balancer.forget(home)
    loads = [0.0, 0.0]
    loads[home] = 0.5
    assert balancer.choose(np.concatenate([system, prompt(2)]), loads, [True, True]) == 1 - home

"""Token buckets on a fake clock: refill, all-or-nothing takes over several buckets, per-process shares."""

from __future__ import annotations

import pytest

from gateway.budgets import Draw, LocalBudgets


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_bucket_refills_its_capacity_over_a_minute() -> None:
    clock = FakeClock()
    budgets = LocalBudgets(clock)
    draw = Draw("k:requests", 6, 1, 1)
    assert [(await budgets.take([draw])).granted for _ in range(7)] == [True] * 6 + [False]
    clock.now += 9.9
    assert not (await budgets.take([draw])).granted, "6 a minute: one more after 10 s, not before"
    clock.now += 0.1
    assert (await budgets.take([draw])).granted


async def test_a_take_over_two_buckets_is_all_or_nothing() -> None:
    budgets = LocalBudgets(FakeClock())
    requests = Draw("k:requests", 10, 1, 1)
    assert (await budgets.take([requests, Draw("k:tokens", 100, 80, 80)])).granted
    refused = await budgets.take([requests, Draw("k:tokens", 100, 30, 30)])
    assert not refused.granted
    assert refused.levels == pytest.approx((9, 20)), "the request bucket kept its request"


async def test_settling_refunds_unused_reservation_and_charges_overdraw() -> None:
    budgets = LocalBudgets(FakeClock())
    tokens = Draw("k:tokens", 100, 60, 60)
    assert (await budgets.take([tokens])).granted
    await budgets.adjust("k:tokens", 100, 60 - 10)  # reserved 60, used 10
    assert (await budgets.take([Draw("k:tokens", 100, 90, 90)])).granted
    await budgets.adjust("k:tokens", 100, 90 - 150)  # reserved 90, used 150: the bucket goes below zero
    assert not (await budgets.take([Draw("k:tokens", 100, 1, 1)])).granted


async def test_each_of_n_processes_gets_one_nth_of_a_budget() -> None:
    budgets = LocalBudgets(FakeClock(), share=0.5)
    draw = Draw("k:requests", 10, 1, 1)
    assert [(await budgets.take([draw])).granted for _ in range(6)] == [True] * 5 + [False]

"""Per-key budgets: token buckets on a fake clock (refill, all-or-nothing takes, per-process shares), and a real
gateway whose every end of a request settles what it used."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.budgets import Draw, LocalBudgets
from gateway.config import GatewayConfig

from ..budget_client import (
    FrozenClock,
    charge_of_next_request,
    charged,
    post,
    prompt_estimate,
    prompt_tokens,
    remaining_tokens,
    stream_and_hang_up,
)
from ..conftest import MODEL, TINY_CONTEXT, TINY_MODEL, RunningGateway, server_sections, start_gateway, stop_gateway


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


# --- per-key token budgets in a real gateway: every end of a request settles what it used ------------------------

KEY = "sk-metered-0123456789"
LABEL = "team"
ADMIN_KEY = "sk-admin-0123456789"
TPM = 100_000
STEP = 4
"""Tokens per engine step: a client that hangs up pays for what it read, give or take one step's tokens."""
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about files."}],
    "max_tokens": 300,
    "ignore_eos": True,
    "logprobs": True,
}


def _metered_config(**server: object) -> GatewayConfig:
    return GatewayConfig(
        server=server_sections(
            api_keys=[{"key": KEY, "name": LABEL, "tokens_per_minute": TPM}], admin_api_key=ADMIN_KEY, **server
        ),
        backends=[
            {
                "name": "reference",
                "kind": "reference",
                "timing": {"decode_seconds_per_step": 0.05, "tokens_per_step": STEP},
            },
            {"name": "tiny", "kind": "reference", "max_model_len": TINY_CONTEXT},
        ],
        models=[{"name": MODEL, "backends": ["reference"]}, {"name": TINY_MODEL, "backends": ["tiny"]}],
    )


@pytest.fixture(scope="module")
def metered() -> Iterator[RunningGateway]:
    """One key with a token budget, on a clock that never refills it: the bucket is the budget less what was
    charged less what is reserved, exactly."""
    running = start_gateway(_metered_config(), budget_clock=FrozenClock())
    yield running
    stop_gateway(running)


def assert_the_budget_holds_what_was_charged_and_nothing_else(gateway: RunningGateway) -> None:
    """A probe request's ``x-ratelimit-remaining-tokens``: the budget, less every charge so far, less the probe's
    own reservation (its prompt estimate and max_tokens). A reservation that was never given back shows here."""
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = charged(gateway, LABEL)
    response = post(gateway.base_url, KEY, probe)
    assert response.status_code == 200, response.text
    assert remaining_tokens(response) == TPM - before - (prompt_estimate(probe) + 2)
    usage = response.json()["usage"]
    assert charge_of_next_request(gateway, LABEL, before) == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_key_that_streams_and_hangs_up_pays_for_what_it_read(metered: RunningGateway) -> None:
    for _ in range(3):
        before = charged(metered, LABEL)
        read = stream_and_hang_up(metered.base_url, KEY, LONG, tokens=100)
        charge = charge_of_next_request(metered, LABEL, before)
        completion = charge - prompt_tokens(metered.base_url, KEY, LONG)  # the engine said how long it was
        assert read <= completion <= read + STEP, f"read {read} tokens, charged {completion} for them"
    assert_the_budget_holds_what_was_charged_and_nothing_else(metered)


def test_a_request_that_fails_before_a_backend_takes_it_gives_its_reservation_back(metered: RunningGateway) -> None:
    before = charged(metered, LABEL)
    for _ in range(4):  # a reservation of 400 tokens each, which a leak would keep for ever
        missing = post(metered.base_url, KEY, {**LONG, "model": "no-such-model", "max_tokens": 400})
        assert missing.status_code == 404
    too_long = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 8}
    refused = post(metered.base_url, KEY, too_long)  # the backend refuses it before any work: nothing to pay
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert charged(metered, LABEL) == before
    assert_the_budget_holds_what_was_charged_and_nothing_else(metered)


def test_the_reservation_covers_the_prompt_and_the_settlement_charges_it_exactly(metered: RunningGateway) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "all about files " * 250}], "max_tokens": 8}
    before = charged(metered, LABEL)
    response = post(metered.base_url, KEY, big)
    assert response.status_code == 200
    reserved = prompt_estimate(big) + 8
    assert reserved > 1000, "a 4 KB prompt is reserved for, not only its max_tokens"
    assert remaining_tokens(response) == TPM - before - reserved
    usage = response.json()["usage"]
    assert charge_of_next_request(metered, LABEL, before) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert_the_budget_holds_what_was_charged_and_nothing_else(metered)


def test_a_request_cut_by_its_deadline_pays_for_what_it_got() -> None:
    running = start_gateway(_metered_config(request_timeout=0.6), budget_clock=FrozenClock())
    try:
        got = 0
        frames: list[dict[str, object]] = []
        with httpx.stream(
            "POST",
            f"{running.base_url}/v1/chat/completions",
            content=orjson.dumps({**LONG, "stream": True}),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=60,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    frames.append(orjson.loads(line[6:]))
        for frame in frames:
            for choice in frame.get("choices", ()):  # type: ignore[attr-defined]
                got += len((choice.get("logprobs") or {}).get("content") or ())
        assert frames[-1]["error"]["code"] == "timeout" and 0 < got < 300  # type: ignore[index]
        charge = charge_of_next_request(running, LABEL, 0)
        assert charge == prompt_tokens(running.base_url, KEY, LONG) + got, "the client read every token it paid for"
    finally:
        stop_gateway(running)

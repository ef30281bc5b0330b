"""Routing pieces on their own: circuit breaker transitions on a controlled clock, policy choices on chosen
loads, the affinity key, and the shadow comparison's verdicts. The gateway-level behaviour is in
test_routing.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from backends.errors import UpstreamError
from backends.interface import Delta, Event, Finish, GenerateRequest, SamplingOptions, Usage
from gateway.config import ModelConfig
from gateway.routing.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from gateway.routing.model_router import ModelRouter
from gateway.routing.policies import LeastOutstandingPolicy, PrefixAffinityPolicy, affinity_key, rendezvous_score
from gateway.routing.shadow import OK, ShadowMirror, ShadowPair
from gateway.routing.stream import RoutedStream
from gateway.routing.targets import BackendLoad, LatencyWindow, Target
from gateway.routing.telemetry import RoutingMetrics

from .test_routing import binomial_bounds


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _StubBackend:
    """Test double: a policy only looks at a backend's name and readiness."""

    kind = "test-double"

    def __init__(self, name: str) -> None:
        self.name = name

    def readiness(self) -> tuple[bool, str]:
        return True, "ready"


def _target(name: str, weight: float = 1.0, in_flight: int = 0) -> Target:
    load = BackendLoad()
    load.in_flight = in_flight
    return Target("m", _StubBackend(name), weight, load, CircuitBreaker(3, 1.0))  # type: ignore[arg-type]


def _chat(text: str, user: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", messages=[{"role": "user", "content": text}], user=user)


# ---- circuit breaker --------------------------------------------------------------------------------------------


def test_breaker_opens_only_after_consecutive_failures() -> None:
    breaker = CircuitBreaker(3, 10.0, clock=_Clock())
    breaker.failed()
    breaker.failed()
    breaker.succeeded()  # a success in between resets the count
    breaker.failed()
    breaker.failed()
    assert breaker.state == CLOSED and breaker.available()
    breaker.failed()
    assert breaker.state == OPEN and not breaker.available()


def test_breaker_lets_one_probe_through_after_the_cooldown_and_closes_when_it_answers() -> None:
    clock = _Clock()
    breaker = CircuitBreaker(1, 10.0, clock=clock)
    breaker.failed()
    clock.now += 9.9
    assert breaker.state == OPEN and not breaker.available()
    clock.now += 0.2
    assert breaker.state == HALF_OPEN and breaker.available()
    assert breaker.acquire() is True  # this request is the probe
    assert not breaker.available(), "a second probe while the first is out"
    breaker.answered()
    assert breaker.state == CLOSED and breaker.available() and breaker.acquire() is False


def test_breaker_reopens_for_a_full_cooldown_when_the_probe_fails() -> None:
    clock = _Clock()
    breaker = CircuitBreaker(1, 10.0, clock=clock)
    breaker.failed()
    clock.now += 10
    breaker.acquire()
    breaker.failed()
    assert breaker.state == OPEN
    clock.now += 9.9
    assert not breaker.available()
    clock.now += 0.2
    assert breaker.available()
    assert breaker.opens == 1, "a failed probe keeps the circuit open; it does not count as a new opening"


def test_breaker_probe_that_tells_nothing_frees_the_slot_and_a_lost_probe_is_replaced() -> None:
    clock = _Clock()
    breaker = CircuitBreaker(1, 10.0, clock=clock)
    breaker.failed()
    clock.now += 10
    breaker.acquire()
    breaker.released()  # e.g. the client went away before the first token
    assert breaker.available()
    breaker.acquire()
    assert not breaker.available()
    clock.now += 10  # the probe never reported back
    assert breaker.available()


# ---- policies ---------------------------------------------------------------------------------------------------


def test_least_outstanding_picks_the_lowest_load_per_weight_and_rotates_ties() -> None:
    a, b, c = _target("a", in_flight=2), _target("b", in_flight=1), _target("c", weight=4, in_flight=3)
    policy = LeastOutstandingPolicy()
    assert {policy.pick([a, b, c], None, None).name for _ in range(6)} == {"c"}  # (3+1)/4 < (1+1)/1
    idle = [_target("x"), _target("y"), _target("z")]
    assert {policy.pick(idle, None, None).name for _ in range(3)} == {"x", "y", "z"}


def test_affinity_key_prefers_session_then_user_then_the_prompt_prefix() -> None:
    shared = "s" * 100
    one, other = _chat(shared + "one"), _chat(shared + "other")
    assert affinity_key(one, None, 100) == affinity_key(other, None, 100)  # differ only past prefix_chars
    assert affinity_key(one, None, 1000) != affinity_key(other, None, 1000)
    assert affinity_key(_chat("a", user="u1"), None, 1000) == affinity_key(_chat("b", user="u1"), None, 1000)
    assert affinity_key(_chat("a", user="u1"), "s1", 1000) == affinity_key(_chat("b", user="u2"), "s1", 1000)
    text = GenerateRequest(request_id="r", model="m", prompt=shared + "x")
    assert affinity_key(text, None, 100) == affinity_key(GenerateRequest("r", "m", prompt=shared + "y"), None, 100)


def test_rendezvous_ranking_moves_only_the_keys_of_a_removed_target() -> None:
    targets = [_target(n) for n in "abcd"]
    policy = PrefixAffinityPolicy(prefix_chars=64, load_factor=1.5)
    keys = [f"conversation {i}" for i in range(200)]
    before = {k: policy.pick(targets, _chat(k), None).name for k in keys}
    assert len(set(before.values())) == 4
    after = {k: policy.pick(targets[:3], _chat(k), None).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "d" for k in moved)


def test_weighted_rendezvous_gives_each_target_its_share_of_keys() -> None:
    heavy, light = _target("heavy", weight=3), _target("light", weight=1)
    keys = [random.Random(i).getrandbits(64) for i in range(2000)]
    heavy_keys = sum(rendezvous_score(k, heavy) > rendezvous_score(k, light) for k in keys)
    low, high = binomial_bounds(len(keys), 0.75)
    assert low <= heavy_keys <= high


def test_bounded_load_passes_a_busy_preferred_target_over_for_the_next_in_its_ranking() -> None:
    targets = [_target(n) for n in "abc"]
    policy = PrefixAffinityPolicy(prefix_chars=64, load_factor=1.5, load_slack=4)
    request = _chat("hot prefix")
    preferred = policy.pick(targets, request, None)
    ranking = sorted(targets, key=lambda t: rendezvous_score(affinity_key(request, None, 64), t), reverse=True)
    assert ranking[0] is preferred
    # the others idle, the preferred target holding L: its bound is 1.5 * (L + 1) / 3 + 4, so it keeps up to 8
    preferred.load.in_flight = 8
    assert policy.pick(targets, request, None) is preferred
    preferred.load.in_flight = 9
    assert policy.pick(targets, request, None) is ranking[1]


# ---- shadow comparison ------------------------------------------------------------------------------------------


def _compared(metrics: RoutingMetrics, aspect: str, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "gateway_shadow_comparisons_total",
        {"model": "m", "primary": "a", "shadow": "s", "aspect": aspect, "result": result, "greedy": "true"},
    )
    return value or 0.0


def test_shadow_comparison_tells_identical_from_different_greedy_answers() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    mirror = ShadowMirror("m", _StubBackend("s"), BackendLoad(), fraction=1.0, max_concurrency=1, metrics=metrics)  # type: ignore[arg-type]
    greedy = GenerateRequest("r", "m", prompt="p", sampling=SamplingOptions(temperature=0))
    for shadow_text, shadow_tokens in (("hello world", 2), ("hello there", 3)):
        pair = ShadowPair(mirror, "a", greedy=greedy.sampling.temperature == 0)
        for capture, text, tokens in ((pair.primary, "hello world", 2), (pair.shadow, shadow_text, shadow_tokens)):
            for event in (Delta(0, text[:5]), Delta(0, text[5:]), Finish(0, "length"), Usage(3, tokens)):
                capture.observe(event)
        pair.shadow.end(OK)
        pair.primary_ended(OK, "a")
    assert _compared(metrics, "text", "match") == 1 and _compared(metrics, "text", "mismatch") == 1
    assert _compared(metrics, "completion_tokens", "match") == 1
    assert _compared(metrics, "completion_tokens", "mismatch") == 1
    assert _compared(metrics, "finish_reason", "match") == 2
    assert mirror.describe()["comparisons"]["a"]["text"] == {"match": 1, "mismatch": 1}


def test_latency_window_keeps_the_most_recent_values() -> None:
    window = LatencyWindow(size=100)
    for ms in range(1000):
        window.add(ms / 1000)
    assert len(window) == 100
    assert window.percentiles_ms() == {"p50": 949.0, "p90": 989.0, "p99": 998.0}


# ---- the routed stream's accounting -----------------------------------------------------------------------------


class _ScriptedBackend:
    """Test double: yields a fixed script of events, or raises one of the backends' errors at a given point, or
    waits forever before its first event (to be cancelled)."""

    kind = "test-double"

    def __init__(self, name: str) -> None:
        self.name = name
        self.fail_at: int | None = None
        self.hang = False
        self.closed = 0

    def readiness(self) -> tuple[bool, str]:
        return True, "ready"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        try:
            if self.hang:
                await asyncio.Event().wait()
            for i, event in enumerate((Delta(0, "a"), Delta(0, "b"), Finish(0, "stop"), Usage(1, 2))):
                if self.fail_at == i:
                    raise UpstreamError(f"{self.name} failed")
                yield event
        finally:
            self.closed += 1


def _scripted_router(**model: Any) -> tuple[ModelRouter, dict[str, _ScriptedBackend]]:
    backends = {name: _ScriptedBackend(name) for name in ("a", "b")}
    config = ModelConfig(name="m", **{"backends": ["a"], "fallbacks": ["b"], **model})
    return ModelRouter([config], backends), backends  # type: ignore[arg-type]


def test_every_way_a_routed_stream_ends_gives_its_in_flight_slot_back_once() -> None:
    async def scenario() -> None:
        router, backends = _scripted_router()
        a, b = router.target("m", "a"), router.target("m", "b")
        request = GenerateRequest("r", "m", prompt="p")

        def open_on(backend: Any) -> AsyncIterator[Event]:
            return backend.generate(request)

        async def drain(stream: RoutedStream) -> list[Event]:
            try:
                return [event async for event in stream]
            finally:
                await stream.aclose()

        def loads() -> tuple[int, int]:
            return a.load.in_flight, b.load.in_flight

        stream = router.route("m", request, None, open_on)
        assert loads() == (1, 0), "counted when routed, before any await"
        assert len(await drain(stream)) == 4 and loads() == (0, 0)

        backends["a"].fail_at = 0  # before the first event: the fallback serves
        stream = router.route("m", request, None, open_on)
        assert len(await drain(stream)) == 4 and stream.backend.name == "b" and loads() == (0, 0)

        backends["a"].fail_at = 2  # after the first event: no fallback
        stream = router.route("m", request, None, open_on)
        with pytest.raises(UpstreamError):
            await drain(stream)
        assert stream.backend.name == "a" and loads() == (0, 0)
        assert a.failures == 2 and b.requests == 1

        backends["a"].fail_at = None
        stream = router.route("m", request, None, open_on)
        await stream.aclose()  # the client left before the request started
        assert loads() == (0, 0)

        backends["a"].hang = True  # the client leaves while waiting for the first event
        stream = router.route("m", request, None, open_on)
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        assert loads() == (1, 0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        # four iterators were opened on "a" (the stream closed before it started never opened one): all closed
        assert loads() == (0, 0) and backends["a"].closed == 4

    asyncio.run(scenario())

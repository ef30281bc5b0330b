"""Several backends behind one model name: policies, pinning, fallbacks, circuit breaking, shadow traffic and
the operator view, against real gateways with reference engines that have different timing models."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.config import ReferenceBackendConfig
from backends.errors import UpstreamError
from backends.interface import Backend, Event, GenerateRequest
from backends.reference.backend import build_reference_backend
from gateway.config import GatewayConfig

from ..conformance import OpenAISchemas
from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_until

TIMING = {
    "fast": {"decode_seconds_per_step": 0.001},
    "slow": {"prefill_seconds_per_token": 0.0005, "decode_seconds_per_step": 0.004},
    "spec": {"decode_seconds_per_step": 0.002, "tokens_per_step": 4},
}
LONG = {"max_tokens": 3000, "ignore_eos": True}


def binomial_bounds(n: int, p: float, alpha: float = 1e-6) -> tuple[int, int]:
    """The central interval holding a Binomial(n, p) count with probability at least 1 - alpha (exact tails):
    a correct split lands outside it once in a million runs."""
    log_pmf = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]
    pmf = [math.exp(v) for v in log_pmf]
    low, tail = 0, 0.0
    while tail + pmf[low] <= alpha / 2:
        tail += pmf[low]
        low += 1
    high, tail = n, 0.0
    while tail + pmf[high] <= alpha / 2:
        tail += pmf[high]
        high -= 1
    return low, high


def _chat(
    http: httpx.Client,
    model: str,
    content: str = "Say something about files.",
    *,
    headers: dict[str, str] | None = None,
    **body: Any,
) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **body}
    return http.post("/v1/chat/completions", json=payload, headers=headers or {})


def _served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-backend"]


def _samples(http: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _targets(http: httpx.Client, model: str) -> dict[str, dict[str, Any]]:
    described = http.get("/admin/targets").json()["models"][model]
    return {t["backend"]: t for t in described["targets"]}


def _shadow(http: httpx.Client, model: str) -> dict[str, Any]:
    return http.get("/admin/targets").json()["models"][model]["shadow"]


@contextlib.contextmanager
def _open_stream(http: httpx.Client, model: str, **body: Any) -> Iterator[tuple[str, Iterator[str]]]:
    """A streamed chat request held open: yields the backend serving it once its first frame arrived."""
    payload = {"model": model, "messages": [{"role": "user", "content": "go on"}], "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        yield response.headers["x-backend"], lines


# ---- one gateway, three timing models, one backend that is down --------------------------------------------------


@pytest.fixture(scope="module")
def routed() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[
            *({"name": name, "kind": "reference", "timing": timing} for name, timing in TIMING.items()),
            {"name": "down", "kind": "lmdeploy", "urls": ["http://127.0.0.1:9"], "health_interval": 60},
        ],
        models=[
            {
                "name": "split",
                "backends": [{"backend": "fast", "weight": 3}, {"backend": "spec", "weight": 1}],
                "allow_pin_header": True,
            },
            {"name": "least", "backends": ["fast", "slow", "spec"], "policy": "least_outstanding"},
            {
                "name": "affinity",
                "backends": ["fast", "slow", "spec"],
                "policy": "prefix_affinity",
                "affinity": {"prefix_chars": 200},
            },
            {"name": "plain", "backends": ["fast"]},
            {"name": "shadowed", "backends": ["fast"], "shadow": {"backend": "slow", "fraction": 1.0}},
            {"name": "rescued", "backends": ["down"], "fallbacks": ["spec"]},
        ],
    )
    running = start_gateway(config, wait_for="/health")  # /ready stays 503: "down" never becomes healthy
    assert wait_until(lambda: all(running.state.backends[n].readiness()[0] for n in TIMING), timeout=120)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def http(routed: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=routed.base_url, timeout=60) as client:
        yield client


def test_weighted_split_follows_the_weights_within_a_binomial_bound(http: httpx.Client) -> None:
    requests = 300
    served = Counter(_served_by(_chat(http, "split")) for _ in range(requests))
    assert set(served) == {"fast", "spec"}
    low, high = binomial_bounds(requests, 3 / 4)
    assert low <= served["fast"] <= high, (served, (low, high))
    assert not low <= requests // 2 <= high, "the bound must be able to tell a 3:1 split from an even one"


def test_least_outstanding_sends_new_requests_to_the_idle_target(http: httpx.Client) -> None:
    with _open_stream(http, "least", **LONG) as (first, _), _open_stream(http, "least", **LONG) as (second, _):
        assert first != second, "the second long request must avoid the busy target"
        idle = ({"fast", "slow", "spec"} - {first, second}).pop()
        shorts = [_served_by(_chat(http, "least")) for _ in range(8)]
        assert shorts == [idle] * 8
        in_flight = {name: t["in_flight"] for name, t in _targets(http, "least").items()}
        assert in_flight == {first: 1, second: 1, idle: 0}, "premise: both long requests were still running"
    assert wait_until(lambda: all(t["in_flight"] == 0 for t in _targets(http, "least").values()))


def test_prefix_affinity_sends_a_shared_prefix_to_the_same_target_every_time(http: httpx.Client) -> None:
    system = "You are a careful assistant. " * 10  # 290 characters: longer than the 200 that key a request
    targets = set()
    for prefix in range(10):
        messages = [{"role": "system", "content": f"{prefix} {system}"}]
        served = {
            _served_by(
                http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "affinity",
                        "messages": [*messages, {"role": "user", "content": f"question {i}"}],
                        "max_tokens": 1,
                    },
                )
            )
            for i in range(4)
        }
        assert len(served) == 1, f"prefix {prefix} went to {served}"
        targets |= served
    assert len(targets) >= 2, "different prefixes should spread over the targets"


def test_session_header_and_user_field_keep_a_session_on_one_target(http: httpx.Client) -> None:
    for session in ("alpha", "beta", "gamma"):
        served = {_served_by(_chat(http, "affinity", f"turn {i}", headers={"X-Session-ID": session})) for i in range(4)}
        assert len(served) == 1
        served = {_served_by(_chat(http, "affinity", f"turn {i}", user=f"user-{session}")) for i in range(4)}
        assert len(served) == 1


def test_pin_header_chooses_the_target_when_the_model_allows_it(http: httpx.Client) -> None:
    assert {_served_by(_chat(http, "split", headers={"X-Backend": "spec"})) for _ in range(10)} == {"spec"}
    stream = _chat(http, "split", headers={"X-Backend": "spec"}, stream=True)
    assert _served_by(stream) == "spec"
    completion = http.post(
        "/v1/completions", json={"model": "split", "prompt": "The", "max_tokens": 1}, headers={"X-Backend": "spec"}
    )
    assert _served_by(completion) == "spec"


def test_pin_header_naming_a_backend_outside_the_model_is_a_400_naming_the_header(http: httpx.Client) -> None:
    response = _chat(http, "split", headers={"X-Backend": "slow"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "X-Backend" and "X-Backend" in error["message"] and "slow" in error["message"]


def test_pin_header_is_ignored_unless_the_model_allows_it(http: httpx.Client) -> None:
    assert _served_by(_chat(http, "plain", headers={"X-Backend": "slow"})) == "fast"


def test_a_target_that_is_down_is_passed_over_for_the_fallback(http: httpx.Client) -> None:
    before = _samples(http)
    assert _served_by(_chat(http, "rescued")) == "spec"
    assert _served_by(_chat(http, "rescued", stream=True)) == "spec"
    after = _samples(http)
    routed = "gateway_routed_requests_total"
    assert (
        _sample(after, routed, model="rescued", backend="spec", via="fallback")
        - _sample(before, routed, model="rescued", backend="spec", via="fallback")
        == 2
    )
    down = _targets(http, "rescued")["down"]
    assert down["ready"] is False and down["requests"] == 0, "a target that is not ready is not even tried"


def test_shadow_never_changes_the_answer_and_shows_up_in_the_comparison(http: httpx.Client) -> None:
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for i in range(4):
        question = f"Tell me about modules, part {i}."
        shadowed = _chat(http, "shadowed", question, **greedy)
        plain = _chat(http, "plain", question, **greedy)
        assert _served_by(shadowed) == "fast"
        assert shadowed.json()["choices"] == plain.json()["choices"]
        assert shadowed.json()["usage"] == plain.json()["usage"]
    sampled = _chat(http, "shadowed", "Anything", max_tokens=12, ignore_eos=True, temperature=1.0, seed=3, stream=True)
    assert _served_by(sampled) == "fast"
    assert wait_until(lambda: _shadow(http, "shadowed")["outcomes"].get("compared") == 5)
    summary = _shadow(http, "shadowed")["comparisons"]["fast"]
    assert summary["compared"] == 5 and summary["greedy"] == 4
    assert summary["text"] == {"match": 4, "mismatch": 0}, "two reference engines agree on greedy text"
    assert summary["finish_reason"]["match"] + summary["finish_reason"]["mismatch"] == 5
    assert summary["ttft_ms"]["primary"] is not None and summary["ttft_ms"]["shadow"] is not None
    samples = _samples(http)
    pair = {"model": "shadowed", "primary": "fast", "shadow": "slow"}
    compared = "gateway_shadow_comparisons_total"
    assert _sample(samples, compared, **pair, aspect="text", result="match", greedy="true") == 4
    assert _sample(samples, compared, **pair, aspect="text", result="match", greedy="false") == 0
    assert _sample(samples, "gateway_shadow_requests_total", **pair, outcome="compared") == 5
    for side in ("primary", "shadow"):
        assert _sample(samples, "gateway_shadow_time_to_first_token_seconds_count", **pair, side=side) == 5
        assert _sample(samples, "gateway_shadow_time_per_output_token_seconds_count", **pair, side=side) == 5
        assert _sample(samples, "gateway_shadow_completion_tokens_total", **pair, side=side) == 4 * 12 + 12
    client_requests = [k for k in samples if k[0] == "gateway_requests_total" and ("model", "shadowed") in k[1]]
    assert client_requests and all(("backend", "fast") in k[1] for k in client_requests), "shadows are not clients"


def test_models_list_each_model_once_with_its_backend_kinds(http: httpx.Client, schemas: OpenAISchemas) -> None:
    listed = http.get("/v1/models").json()
    schemas.check("ListModelsResponse", listed)
    kinds = {m["id"]: m["backend_kinds"] for m in listed["data"]}
    assert list(kinds) == ["split", "least", "affinity", "plain", "shadowed", "rescued"]
    assert kinds["least"] == ["reference"] and kinds["shadowed"] == ["reference"]
    assert kinds["rescued"] == ["lmdeploy", "reference"]
    one = http.get("/v1/models/rescued").json()
    schemas.check("Model", one)
    assert one["backend_kinds"] == ["lmdeploy", "reference"]


def test_admin_targets_lists_health_load_latency_and_circuit_per_target(http: httpx.Client) -> None:
    for _ in range(5):
        _served_by(_chat(http, "split", headers={"X-Backend": "fast"}))
    described = http.get("/admin/targets").json()["models"]
    split = described["split"]
    assert split["policy"] == "weighted" and split["allow_pin_header"] is True and split["shadow"] is None
    fast = {t["backend"]: t for t in split["targets"]}["fast"]
    assert fast["kind"] == "reference" and fast["roles"] == ["primary"] and fast["weight"] == 3
    assert fast["ready"] is True and fast["in_flight"] == 0
    assert fast["circuit"]["state"] == "closed" and fast["circuit"]["consecutive_failures"] == 0
    latency = fast["latency"]
    assert latency["samples"] >= 5 and set(latency["ttft_ms"]) == {"p50", "p90", "p99"}
    assert latency["ttft_ms"]["p50"] <= latency["e2e_ms"]["p99"]
    down = {t["backend"]: t for t in described["rescued"]["targets"]}["down"]
    assert down["ready"] is False and "LMDeploy" in down["reason"] and down["roles"] == ["primary"]
    assert described["rescued"]["fallbacks"] == ["spec"]


# ---- faults the reference engine cannot produce on demand: test doubles ------------------------------------------


class _TestDoubleFaultyBackend:
    """TEST DOUBLE: a real reference backend whose requests the test makes fail before their first event (as
    an engine that dies or an upstream that refuses does) or after some events (mid-stream)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.kind = inner.kind
        self.fail_before_first_event = False
        self.fail_after_events: int | None = None
        self.attempts = 0

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def readiness(self) -> tuple[bool, str]:
        return self.inner.readiness()

    def max_model_len(self) -> int | None:
        return self.inner.max_model_len()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.attempts += 1
        if self.fail_before_first_event:
            raise UpstreamError(f"test double {self.name}: the engine failed the request")
        async with contextlib.aclosing(self.inner.generate(request)) as events:  # type: ignore[type-var]
            sent = 0
            async for event in events:
                if self.fail_after_events is not None and sent >= self.fail_after_events:
                    raise UpstreamError(f"test double {self.name}: the engine failed mid-stream")
                yield event
                sent += 1


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reference(name: str, **timing: float) -> Backend:
    return build_reference_backend(ReferenceBackendConfig(name=name, timing=timing))


@pytest.fixture(scope="module")
def faulty() -> Iterator[tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]]]:
    doubles = {
        name: _TestDoubleFaultyBackend(_reference(name, decode_seconds_per_step=0.001))
        for name in ("flaky", "broken", "shaky")
    }
    backends: dict[str, Backend] = {"fast": _reference("fast"), **doubles}
    config = GatewayConfig(
        backends=[{"name": name, "kind": "reference"} for name in backends],
        models=[
            {"name": "fb", "backends": ["flaky"], "fallbacks": ["fast"]},
            {"name": "nofb", "backends": ["broken"], "fallbacks": ["fast"]},
            {
                "name": "brk",
                "backends": ["shaky"],
                "fallbacks": ["fast"],
                "circuit_breaker": {"failure_threshold": 2, "cooldown_seconds": 5},
            },
            {"name": "shadow-fails", "backends": ["fast"], "shadow": {"backend": "flaky", "fraction": 1.0}},
        ],
    )
    running = start_gateway(config, backends=backends)
    yield running, doubles
    stop_gateway(running)


@pytest.fixture(scope="module")
def faulty_http(faulty: tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=faulty[0].base_url, timeout=60) as client:
        yield client


def _data_frames(response: httpx.Response) -> list[Any]:
    return [
        orjson.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]


def _assert_whole_answer(response: httpx.Response, stream: bool) -> None:
    """A whole answer (streamed to its finish reason and ``[DONE]``) with no error object in it, whole or in any
    frame. The generated text may say anything, "errors" too, so the text is not searched."""
    if stream:
        frames = _data_frames(response)
        assert frames[-1] == "[DONE]", response.text
        answers = frames[:-1]
    else:
        answers = [response.json()]
    assert all("error" not in answer and answer["choices"] for answer in answers), response.text
    assert answers[-1]["choices"][0]["finish_reason"] in ("stop", "length"), response.text


def test_fallback_serves_the_request_when_the_target_fails_before_its_first_event(
    faulty: tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]], faulty_http: httpx.Client
) -> None:
    _, doubles = faulty
    flaky = doubles["flaky"]
    flaky.fail_before_first_event = True
    try:
        before = _samples(faulty_http)
        attempts = flaky.attempts
        whole = _chat(faulty_http, "fb", max_tokens=5)
        streamed = _chat(faulty_http, "fb", max_tokens=5, stream=True)
        completion = faulty_http.post(
            "/v1/completions", json={"model": "fb", "prompt": ["One", "Two"], "max_tokens": 3}
        )
        assert flaky.attempts == attempts + 4, "tried, not skipped (the completion's two prompts are two requests)"
        assert [_served_by(r) for r in (whole, streamed, completion)] == ["fast"] * 3
        assert whole.json()["choices"][0]["message"]["content"]
        assert _data_frames(streamed)[-1] == "[DONE]" and "error" not in _data_frames(streamed)[-2]
        assert len(completion.json()["choices"]) == 2
        after = _samples(faulty_http)

        def grew(name: str, **labels: str) -> float:
            return _sample(after, name, **labels) - _sample(before, name, **labels)

        assert grew("gateway_routed_requests_total", model="fb", backend="fast", via="fallback") == 3
        assert grew("gateway_target_failures_total", model="fb", backend="flaky", stage="before_first_event") == 3
        assert grew("gateway_requests_total", model="fb", backend="fast", status="200") == 3, "labelled by server"
        assert grew("gateway_requests_total", model="fb", backend="flaky", status="200") == 0
        assert _sample(after, "gateway_requests_in_flight", model="fb", backend="flaky") == 0
    finally:
        flaky.fail_before_first_event = False
    assert _served_by(_chat(faulty_http, "fb")) == "flaky"


def test_no_fallback_after_the_first_event_a_mid_stream_failure_ends_in_an_error_frame(
    faulty: tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]], faulty_http: httpx.Client
) -> None:
    _, doubles = faulty
    broken = doubles["broken"]
    broken.fail_after_events = 2
    try:
        fast_before = _sample(
            _samples(faulty_http), "gateway_routed_requests_total", model="nofb", backend="fast", via="fallback"
        )
        streamed = _chat(faulty_http, "nofb", max_tokens=50, ignore_eos=True, stream=True)
        assert _served_by(streamed) == "broken"
        frames = _data_frames(streamed)
        assert frames[-1] == "[DONE]" and frames[-2]["error"]["type"] == "server_error"
        answers = frames[:-2]
        assert len(answers) == 2 and all(len(f["choices"]) == 1 for f in answers), "exactly the two events sent"
        assert len({f["id"] for f in answers}) == 1, "one answer, never a second one from another target"
        whole = _chat(faulty_http, "nofb", max_tokens=50, ignore_eos=True)
        assert whole.status_code == 502, "committed at the first event, even though no byte was sent yet"
        samples = _samples(faulty_http)
        assert (
            _sample(samples, "gateway_routed_requests_total", model="nofb", backend="fast", via="fallback")
            == fast_before
        )
        assert (
            _sample(samples, "gateway_target_failures_total", model="nofb", backend="broken", stage="mid_stream") == 2
        )
        assert wait_until(lambda: _targets(faulty_http, "nofb")["broken"]["in_flight"] == 0)
        engine_driver = broken.inner.driver  # type: ignore[attr-defined]
        assert wait_until(lambda: engine_driver.in_flight == 0), "the failed request's engine work ended"
    finally:
        broken.fail_after_events = None


def test_circuit_opens_after_consecutive_failures_and_closes_after_a_successful_probe(
    faulty: tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]], faulty_http: httpx.Client
) -> None:
    running, doubles = faulty
    shaky = doubles["shaky"]
    breaker = running.state.router.target("brk", "shaky").breaker
    clock = _FakeClock()
    breaker.clock = clock  # the cool-down passes when the test says so, not after a sleep

    def state() -> tuple[str, float]:
        gauge = _sample(_samples(faulty_http), "gateway_circuit_state", model="brk", backend="shaky")
        return _targets(faulty_http, "brk")["shaky"]["circuit"]["state"], gauge

    shaky.fail_before_first_event = True
    try:
        assert state() == ("closed", 0)
        assert [_served_by(_chat(faulty_http, "brk")) for _ in range(2)] == ["fast", "fast"]
        assert shaky.attempts == 2 and state() == ("open", 2)
        assert _served_by(_chat(faulty_http, "brk")) == "fast"
        assert shaky.attempts == 2, "an open circuit keeps requests away from the target"
        clock.now += 5
        assert state() == ("half_open", 1)
        assert _served_by(_chat(faulty_http, "brk")) == "fast"
        assert shaky.attempts == 3 and state() == ("open", 2), "the failed probe reopened the circuit"
        shaky.fail_before_first_event = False
        clock.now += 5
        assert _served_by(_chat(faulty_http, "brk")) == "shaky", "the probe is served by the recovered target"
        assert state() == ("closed", 0)
        assert {_served_by(_chat(faulty_http, "brk")) for _ in range(3)} == {"shaky"}
    finally:
        shaky.fail_before_first_event = False


def test_a_failing_shadow_never_reaches_the_client(
    faulty: tuple[RunningGateway, dict[str, _TestDoubleFaultyBackend]], faulty_http: httpx.Client
) -> None:
    _, doubles = faulty
    doubles["flaky"].fail_before_first_event = True
    try:
        for stream in (False, True):
            response = _chat(faulty_http, "shadow-fails", max_tokens=4, stream=stream)
            assert _served_by(response) == "fast"
            _assert_whole_answer(response, stream)
        assert wait_until(lambda: _shadow(faulty_http, "shadow-fails")["outcomes"].get("shadow_failed") == 2)
    finally:
        doubles["flaky"].fail_before_first_event = False


def test_shadow_work_over_its_cap_is_dropped_and_cancelled_at_shutdown() -> None:
    config = GatewayConfig(
        backends=[
            {"name": "fast", "kind": "reference"},
            {"name": "glacial", "kind": "reference", "timing": {"decode_seconds_per_step": 0.5}},
        ],
        models=[
            {
                "name": "m",
                "backends": ["fast"],
                "shadow": {"backend": "glacial", "fraction": 1.0, "max_concurrency": 1},
            }
        ],
    )
    running = start_gateway(config)
    try:
        with httpx.Client(base_url=running.base_url, timeout=60) as http:
            body = {"max_tokens": 20, "ignore_eos": True}
            assert _served_by(_chat(http, "m", **body)) == "fast"
            assert _shadow(http, "m")["in_flight"] == 1, "the client got its answer while the shadow still runs"
            for _ in range(3):
                assert _served_by(_chat(http, "m", **body)) == "fast"
            shadow = _shadow(http, "m")
            assert shadow["in_flight"] == 1 and shadow["outcomes"] == {"dropped": 3}
            assert running.driver_in_flight("glacial") == 1, "dropped shadow requests never reached the backend"
            samples = _samples(http)
            assert _sample(samples, "gateway_shadow_requests_in_flight", model="m", shadow="glacial") == 1
    finally:
        stop_gateway(running)
    (mirror,) = running.state.router.shadows()
    assert mirror.outcomes == {"dropped": 3, "cancelled": 1} and mirror.active == 0

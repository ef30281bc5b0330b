"""Flow control under a flood (README, Flow control): service tiers, fair sharing between keys, shedding at arrival.

One real gateway on the reference engine with its timing model and 4 slots (``max_num_seqs`` and ``max_in_flight``);
the light-key and priority tests also behind two data-parallel ranks of 2 slots, and in front of LMDeploy's real
api_server (the harness node, whose stub engine takes as long a step). Every flood test holds the 4 slots with long
streams of the flooding key, queues the flood behind them, lets the late arrivals queue too (the gateway's own queue
depth says when), then frees the slots by closing the long streams and records the order in which the queued
requests' first tokens arrive: a slot is handed to a waiter only when a request ends, so the order of first tokens
is the order of admission wave by wave. Assertions are on that order and on counts, never on how long anything took.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.capabilities import GatedBackend
from gateway.config import GatewayConfig

from ..backends.lmdeploy.harness.server import API_KEY, MODEL_NAME, make_node
from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway, wait_until

SLOTS = 4
STEP_SECONDS = 0.01
"""Decode time of the reference engine's timing model: a queued request of ``SHORT`` tokens holds its slot for
about 0.3 s, so the next wave of admissions comes that long after the first tokens of the one before."""
SHORT = 30
HELD = 2000
"""Tokens the slot-holding streams ask for: they end only when the test closes them."""
FLOOD = 12
KEYS = {
    "flood": "sk-flood-0000000001",
    "light": "sk-light-0000000002",
    "heavy": "sk-heavy-0000000003",  # weight 3
    "standard": "sk-standard-00000004",  # may not use priority; flex by default
    "budget": "sk-budget-0000000005",  # a token budget that fits exactly one request
    "premium": "sk-premium-000000006",  # priority by default
}
HI = [{"role": "user", "content": f"hi [[stub delay={STEP_SECONDS}]]"}]
"""The prompt of every request: an LMDeploy harness node's stub engine takes its directive (a step's time), the
reference engine reads it as text."""
SESSION_LEN = 4096


def _config(budget_tokens: int, ranks: int = 1, lmdeploy: str | None = None) -> GatewayConfig:
    """``ranks``: data-parallel ranks of the reference engine; ``lmdeploy``: an LMDeploy node's URL instead."""
    engine: dict[str, Any] = {
        "kind": "reference",
        "max_num_seqs": SLOTS // ranks,  # per rank
        "data_parallel_size": ranks,
        "timing": {"decode_seconds_per_step": STEP_SECONDS},
    }
    if lmdeploy is not None:  # the harness node's stub engine sleeps STEP_SECONDS a step (the prompt's directive)
        engine = {"kind": "lmdeploy", "urls": [lmdeploy], "api_key": API_KEY, "max_model_len": SESSION_LEN}
    return GatewayConfig(
        server={
            "auth": {
                "api_keys": [
                    {"key": KEYS["flood"], "name": "flood"},
                    {"key": KEYS["light"], "name": "light"},
                    {"key": KEYS["heavy"], "name": "heavy", "weight": 3},
                    {
                        "key": KEYS["standard"],
                        "name": "standard",
                        "service_tiers": ["default", "flex"],
                        "default_service_tier": "flex",
                    },
                    {"key": KEYS["budget"], "name": "budget", "tokens_per_minute": budget_tokens},
                    {"key": KEYS["premium"], "name": "premium", "default_service_tier": "priority"},
                ],
                "admin_api_key": "sk-admin-000000000",
            }
        },
        backends=[
            {
                "name": "reference",  # the backend the tests watch, whatever its kind
                "max_in_flight": SLOTS,
                "max_queue": 64,
                "queue_timeout": 60,
                "tiers": {"flex": {"queue_timeout": 1.0}},
                **engine,
            }
        ],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )


BUDGET_BODY = {"model": MODEL, "messages": HI, "max_tokens": SHORT, "service_tier": "flex"}
"""The budget key's request: its reservation is its body's size over 4 plus ``max_tokens``."""


def _reservation(body: dict[str, Any]) -> int:
    return math.ceil(len(orjson.dumps(body)) / 4) + body["max_tokens"]


@pytest.fixture(scope="module")
def flow() -> Iterator[RunningGateway]:
    running = start_gateway(_config(_reservation(BUDGET_BODY)), budget_clock=lambda: 0.0)  # budgets never refill
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def ranked_flow() -> Iterator[RunningGateway]:
    """The same behind two data-parallel ranks of 2 slots each, in worker processes: the queue is the gateway's,
    in front of the dispatcher that balances admitted requests over the ranks."""
    running = start_gateway(_config(_reservation(BUDGET_BODY), ranks=2), budget_clock=lambda: 0.0)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def lmdeploy_flow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """The same in front of LMDeploy's real api_server (the harness node, its stub engine): the node would take
    every request at once; the gateway admits 4 and keeps the rest in its queues."""
    node = make_node(
        tmp_path_factory.mktemp("flow-lmdeploy"),
        "flow",
        "--model-name",
        MODEL_NAME,
        "--session-len",
        str(SESSION_LEN),
        "--api-keys",
        API_KEY,
    ).start()
    running = start_gateway(_config(_reservation(BUDGET_BODY), lmdeploy=node.url), budget_clock=lambda: 0.0)
    yield running
    stop_gateway(running)
    node.stop()


def _client(gateway: RunningGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=KEYS[key], max_retries=0, timeout=120)


def _gate(gateway: RunningGateway) -> Any:
    backend = gateway.state.backends["reference"]
    assert isinstance(backend, GatedBackend)
    return backend.gate


class Flood:
    """Streams started from threads; ``firsts`` lists their names in the order their first tokens arrived."""

    def __init__(self, gateway: RunningGateway) -> None:
        self.gateway = gateway
        self.firsts: list[str] = []
        self.tiers: dict[str, set[str]] = {}
        self._pool = ThreadPoolExecutor(max_workers=32)
        self._lock = threading.Lock()
        self.futures: list[Future[None]] = []

    def send(self, name: str, key: str, **body: Any) -> None:
        self.futures.append(self._pool.submit(self._stream, name, key, body))

    def _stream(self, name: str, key: str, body: dict[str, Any]) -> None:
        client = _client(self.gateway, key)
        stream = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=SHORT, stream=True, extra_body={"ignore_eos": True}, **body
        )
        first = True
        for chunk in stream:
            if first and chunk.choices and chunk.choices[0].delta.content:
                first = False
                with self._lock:
                    self.firsts.append(name)
            self.tiers.setdefault(name, set()).add(str(chunk.service_tier))

    def wait(self) -> None:
        for future in self.futures:
            future.result(timeout=120)
        self._pool.shutdown()


class HeldSlots:
    """``SLOTS`` streams of the flooding key that hold every slot until ``release``."""

    def __init__(self, gateway: RunningGateway) -> None:
        client = _client(gateway, "flood")
        self.streams = []
        for _ in range(SLOTS):
            stream = client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=HELD, stream=True, extra_body={"ignore_eos": True}
            )
            next(iter(stream))  # running: it holds a slot
            self.streams.append(stream)

    def release(self) -> None:
        for stream in self.streams:
            stream.close()  # the client hangs up: the engine aborts it and its slot passes to a waiter


def _queued(gateway: RunningGateway, count: int) -> None:
    assert wait_until(lambda: _gate(gateway).queued == count, timeout=60), f"{_gate(gateway).queued} queued"


def _flooded(gateway: RunningGateway, late: Callable[[Flood], int]) -> Flood:
    """Holds the slots, queues ``FLOOD`` requests of the flooding key, then what ``late`` sends (it returns how
    many), frees the slots and waits for every answer."""
    held = HeldSlots(gateway)
    flood = Flood(gateway)
    for i in range(FLOOD):
        flood.send(f"flood-{i}", "flood")
        _queued(gateway, i + 1)  # one at a time, so their arrival order is their names' order
    _queued(gateway, FLOOD + late(flood))
    held.release()
    flood.wait()
    return flood


@pytest.mark.parametrize("layout", ["flow", "ranked_flow", "lmdeploy_flow"])
def test_a_light_key_is_admitted_as_soon_as_a_slot_frees_while_the_flooding_key_waits_its_turn(
    layout: str, request: pytest.FixtureRequest
) -> None:
    flow: RunningGateway = request.getfixturevalue(layout)

    def light(flood: Flood) -> int:
        flood.send("light-0", "light")
        flood.send("light-1", "light")
        return 2

    order = _flooded(flow, light).firsts
    assert len(order) == FLOOD + 2, order
    # Fair sharing: the light key's two requests alternate with the flood's first ones, in the first wave of
    # admissions; first come, first served would put them after all twelve.
    last_light = max(order.index("light-0"), order.index("light-1"))
    assert last_light < SLOTS, order
    assert sum(1 for name in order[:last_light] if name.startswith("flood")) <= 2, order


@pytest.mark.parametrize("layout", ["flow", "ranked_flow", "lmdeploy_flow"])
def test_priority_requests_get_their_first_token_before_the_default_flood_sent_before_them(
    layout: str, request: pytest.FixtureRequest
) -> None:
    flow: RunningGateway = request.getfixturevalue(layout)

    def priority(flood: Flood) -> int:
        flood.send("priority-0", "flood", service_tier="priority")
        flood.send("priority-1", "flood", service_tier="priority")
        return 2

    flood = _flooded(flow, priority)
    # Both in the first wave of admissions (the order within a wave is the engine's); first come, first served
    # would put them last.
    assert {"priority-0", "priority-1"} <= set(flood.firsts[:SLOTS]), flood.firsts
    assert flood.tiers["priority-0"] == {"priority"} and flood.tiers["flood-0"] == {"default"}


def test_a_heavier_key_gets_its_weighted_share_of_the_slots(flow: RunningGateway) -> None:
    def heavy(flood: Flood) -> int:
        for i in range(FLOOD):
            flood.send(f"heavy-{i}", "heavy")
        return FLOOD

    order = _flooded(flow, heavy).firsts
    # Weights 3 to 1, both backlogged: of the first two waves (8 admitted), 6 are the heavy key's (the flood
    # queued first and wins ties); first come, first served would admit the flood's 12 first.
    assert sum(1 for name in order[: 2 * SLOTS] if name.startswith("heavy")) == 6, order


def test_a_request_that_cannot_be_admitted_in_its_tiers_time_is_refused_at_arrival_and_frees_its_budget(
    flow: RunningGateway,
) -> None:
    """The flex tier waits at most 1 s here. Once the gateway has seen how long a slot is held, a flex request
    behind a queue that takes longer is refused at once (it never waits: ``queue_ms`` 0), with Retry-After, and
    its budget reservation comes back: the budget key's tokens fit one request, and the next one is refused by
    flow control again, not by the budget."""
    warm = Flood(flow)
    for i in range(SLOTS):
        warm.send(f"warm-{i}", "flood")
    warm.wait()  # slots were held and freed: the mean service time is known
    shed_before = flow.metric("gateway_admission_shed_total", tier="flex", key="budget", reason="predicted_wait")
    with captured_logs(flow) as logs:
        held = HeldSlots(flow)
        flood = Flood(flow)
        try:
            needed = 1 + int(1.0 * SLOTS / _gate(flow).mean_service)  # waiters whose service takes over 1 s
            for i in range(needed):
                flood.send(f"flood-{i}", "flood")
            _queued(flow, needed)
            with httpx.Client(base_url=flow.base_url, timeout=60) as http:
                headers = {"Authorization": f"Bearer {KEYS['budget']}", "Content-Type": "application/json"}
                for _ in range(2):
                    refused = http.post("/v1/chat/completions", content=orjson.dumps(BUDGET_BODY), headers=headers)
                    assert refused.status_code == 503, refused.text  # 429 if the first kept its reservation
                    assert refused.json()["error"]["code"] == "backend_saturated"
                    assert int(refused.headers["retry-after"]) >= 1
            assert _gate(flow).queued == needed, "nothing queued ahead was admitted meanwhile"
        finally:
            held.release()
            flood.wait()
    lines = [line for line in logs if line.get("event") == "request" and line.get("api_key") == "budget"]
    assert [(line["admission"], line["queue_ms"], line["service_tier"]) for line in lines] == [
        ("predicted_wait", 0.0, "flex")
    ] * 2
    assert [line["charged_tokens"] for line in lines] == [0, 0]
    shed = flow.metric("gateway_admission_shed_total", tier="flex", key="budget", reason="predicted_wait")
    assert shed - shed_before == 2


def test_a_request_that_leaves_while_queued_is_not_charged(flow: RunningGateway) -> None:
    body = orjson.dumps({"model": MODEL, "messages": HI, "max_tokens": SHORT, "stream": True})
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEYS["budget"].encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    with captured_logs(flow) as logs:
        held = HeldSlots(flow)
        try:
            host, port = flow.base_url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(request)
                _queued(flow, 1)
            _queued(flow, 0)  # it hung up while it waited for a slot
        finally:
            held.release()
    (line,) = [line for line in logs if line.get("event") == "request" and line.get("api_key") == "budget"]
    assert (line["admission"], line["charged_tokens"]) == ("left", 0), line


def test_the_tier_a_key_may_use_is_echoed_in_every_body_and_chunk(flow: RunningGateway) -> None:
    standard = _client(flow, "standard")
    asked = standard.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, service_tier="priority")
    assert asked.service_tier == "flex"  # may not use priority: its default, not an error
    chunks = list(
        standard.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True, service_tier="default")
    )
    assert chunks and {chunk.service_tier for chunk in chunks} == {"default"}
    completion = standard.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert completion.service_tier == "flex"  # type: ignore[attr-defined]
    light = _client(flow, "light")
    streamed = list(
        light.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, stream=True, extra_body={"service_tier": "auto"}
        )
    )
    assert {getattr(chunk, "service_tier", None) for chunk in streamed} == {"default"}
    scale = light.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, service_tier="scale")
    assert scale.service_tier == "default"  # OpenAI's scale tier is not one of ours: the key's default
    premium = _client(flow, "premium")
    fast = premium.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, service_tier="fast")
    assert fast.service_tier == "priority"  # OpenAI's fast mode is its priority tier, echoed as such
    response = light.responses.create(model=MODEL, input="hi", max_output_tokens=4, service_tier="priority")
    assert response.service_tier == "priority"
    events = list(standard.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True))
    tiers = {event.response.service_tier for event in events if hasattr(event, "response")}
    assert tiers == {"flex"}
    claude = anthropic.Anthropic(base_url=flow.base_url, api_key=KEYS["premium"], max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=HI, service_tier="auto")
    assert message.usage.service_tier == "priority"  # auto: the key's default
    with claude.messages.stream(model=MODEL, max_tokens=4, messages=HI, service_tier="standard_only") as stream:
        assert stream.get_final_message().usage.service_tier == "standard"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HI, "service_tier": "batch"}),
        ("/v1/completions", {"prompt": "hi", "service_tier": "batch"}),
        ("/v1/responses", {"input": "hi", "service_tier": "batch"}),
        ("/v1/chat/completions", {"messages": HI, "priority": "high"}),
    ],
)
def test_clients_cannot_ask_for_the_internal_batch_tier(flow: RunningGateway, path: str, body: dict[str, Any]) -> None:
    answer = httpx.post(
        f"{flow.base_url}{path}",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {KEYS['light']}"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == ("priority" if "priority" in body else "service_tier")
    assert error["type"] == "invalid_request_error"


def test_queue_depth_and_waits_are_exported_by_tier_and_key(flow: RunningGateway) -> None:
    held = HeldSlots(flow)
    flood = Flood(flow)
    try:
        flood.send("standard", "standard", service_tier="default")
        flood.send("light", "light", service_tier="priority")
        _queued(flow, 2)
        depth = "gateway_admission_queue_depth"
        assert flow.metric(depth, backend="reference", tier="default", key="standard") == 1
        assert flow.metric(depth, backend="reference", tier="priority", key="light") == 1
        assert flow.metric("vllm:num_requests_waiting", backend="reference") == 2
        assert flow.metric("vllm:num_requests_running", backend="reference") == SLOTS
        waited = flow.metric("gateway_admission_wait_seconds_count", tier="priority", key="light")
    finally:
        held.release()
        flood.wait()
    assert flow.metric("gateway_admission_wait_seconds_count", tier="priority", key="light") == waited + 1


def test_a_shadow_copy_leaves_the_clients_log_line_to_the_client() -> None:
    """The primary has no admission bound, its shadow does: the client's log line has no admission of its own, and
    the shadow's (which starts while the primary still decodes) must not be written into it."""
    config = GatewayConfig(
        backends=[
            {
                "name": "reference",
                "kind": "reference",
                "max_in_flight": None,
                "timing": {"decode_seconds_per_step": STEP_SECONDS},
            },
            {"name": "spare", "kind": "reference", "max_in_flight": SLOTS},
        ],
        models=[{"name": MODEL, "backends": ["reference"], "shadow": {"backend": "spare", "fraction": 1.0}}],
    )
    running = start_gateway(config)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        with captured_logs(running) as logs:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=SHORT, extra_body={"ignore_eos": True})
        assert wait_until(lambda: all(s.active == 0 for s in running.state.router.shadows()))
        (line,) = [line for line in logs if line.get("event") == "request"]
        assert line["backend"] == "reference" and "admission" not in line, line
    finally:
        stop_gateway(running)

"""OpenTelemetry traces, as a collector receives them: a real OTLP/HTTP receiver on loopback (``tests/otlp.py``)
decodes what the gateway's exporter posts.

The gateways here export to it (``server.tracing.endpoint``); a test sends a request with a caller's W3C
``traceparent`` through the official SDK or raw HTTP, flushes the app's exporter (the batch processor would send
on its own after a few seconds) and reads the trace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig

from ..conftest import RunningGateway, start_gateway, stop_gateway, wait_for_requests_done, wait_until
from ..otlp import OTLPReceiver, ReceivedSpan
from ..processes import free_port, front_ends, is_ready

SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def caller() -> tuple[str, str, str]:
    """A caller's trace: (trace id, its span id, the traceparent naming them, sampled)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def chat(base_url: str, model: str, headers: dict[str, str], content: str = "hi", **body: Any) -> httpx.Response:
    """A chat completion with one user message (two tokens unless ``body`` says otherwise)."""
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **body},
        headers=headers,
        timeout=60,
    )


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    found: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    named = [s for s in spans if s.name == name]
    assert len(named) == 1, (name, [s.name for s in spans])
    return named[0]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return sorted((s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced(receiver: OTLPReceiver) -> Iterator[RunningGateway]:
    """Tracing on, exporting to the receiver: a model on a gated reference backend, one on a backend whose only
    slot a test can hold (its fallback serves the rest), one mirrored to a shadow, one on two data-parallel ranks."""
    config = GatewayConfig(
        server={"tracing": {"endpoint": receiver.endpoint}},
        backends=[
            {"name": "reference", "kind": "reference", "max_in_flight": 8},
            # 20 ms per step: a stream of 500 tokens holds the only slot for seconds, until the test closes it
            {
                "name": "busy",
                "kind": "reference",
                "max_in_flight": 1,
                "max_queue": 0,
                "timing": {"decode_seconds_per_step": 0.02},
            },
            {"name": "spare", "kind": "reference"},
            {"name": "ranked", "kind": "reference", "data_parallel_size": 2},
        ],
        models=[
            {"name": "m", "backends": ["reference"]},
            {"name": "held", "backends": ["busy"], "fallbacks": ["spare"]},
            {"name": "mirrored", "backends": ["reference"], "shadow": {"backend": "spare", "fraction": 1.0}},
            {"name": "ranked", "backends": ["ranked"]},
        ],
    )
    running = start_gateway(config)
    # /ready needs one ready target per model: a fallback may be ready before the target it stands in for
    assert wait_until(lambda: all(b.readiness()[0] for b in running.state.backends.values()), timeout=120)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def client(traced: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{traced.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def exported(gateway: RunningGateway) -> bool:
    """Every span of the requests made so far sent: a request's server span ends after its response's last byte."""
    wait_for_requests_done(gateway)
    return gateway.state.tracing is not None and gateway.state.tracing.flush()


def trace_of(gateway: RunningGateway, receiver: OTLPReceiver, trace_id: str) -> list[ReceivedSpan]:
    assert exported(gateway)
    return receiver.spans(trace_id)


def test_a_request_with_the_callers_traceparent_is_one_trace_below_the_callers_span(
    traced: RunningGateway, receiver: OTLPReceiver, client: openai.OpenAI
) -> None:
    trace_id, parent_id, traceparent = caller()
    reply = client.chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": "Say one word."}],
        max_tokens=12,
        temperature=0,
        response_format=SCHEMA,  # type: ignore[arg-type]
        extra_headers={"traceparent": traceparent, "tracestate": "vendor=abc", "X-Request-ID": "trace-req-1"},
    )
    usage = reply.parse().usage
    assert usage is not None
    spans = trace_of(traced, receiver, trace_id)
    assert spans, "no span carries the caller's trace id"

    server = only(spans, "POST /v1/chat/completions")
    assert server.kind == "server" and server.parent_span_id == parent_id
    assert server.attributes["gateway.request_id"] == "trace-req-1" == reply.headers["x-request-id"]
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "m"
    assert server.attributes["gateway.backend"] == "reference"
    assert server.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert server.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert "error.type" not in server.attributes and not server.error

    route, call = children(spans, server)
    assert route.name == "gateway.route"
    assert route.attributes["gateway.route.target"] == "reference"
    assert route.attributes["gateway.route.via"] == "weighted"
    assert call.name == "chat m" and call.kind == "client"
    assert call.attributes["gen_ai.operation.name"] == "chat"
    assert call.attributes["gen_ai.provider.name"] == "reference"
    assert call.attributes["gen_ai.request.max_tokens"] == 12
    assert call.attributes["gen_ai.request.temperature"] == 0
    assert call.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert call.attributes["gen_ai.response.finish_reasons"] == [reply.parse().choices[0].finish_reason]
    assert call.attributes["gen_ai.latency.time_to_first_token"] > 0

    admission, prepare = children(spans, call)
    assert admission.name == "gateway.admission"
    assert admission.attributes["gen_ai.latency.time_in_queue"] >= 0
    # The numbers of the request's log line (README, Flow control): its tier, fate and wait.
    assert admission.attributes["gateway.admission.service_tier"] == "default"
    assert admission.attributes["gateway.admission.admission"] == "admitted"
    assert admission.attributes["gateway.admission.queue_ahead"] == 0
    assert prepare.name == "engine.prepare_prompt"
    assert prepare.attributes["gateway.prompt.tokens"] == usage.prompt_tokens
    parts = ("queue", "render", "tokenize", "compile")
    timed = [prepare.attributes[f"gateway.prompt.{part}_s"] for part in parts]
    assert all(t >= 0 for t in timed) and sum(timed) <= (prepare.end_ns - prepare.start_ns) / 1e9
    assert timed[3] > 0, "the schema's grammar was compiled"
    assert len(spans) == 5, sorted(s.name for s in spans)
    for span in spans:
        assert server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns, span.name
    assert server.resource["service.name"] == "deepinfer-gateway"


def test_a_stream_records_its_first_token_and_sums_up_its_decode_on_the_backend_call(
    traced: RunningGateway, receiver: OTLPReceiver
) -> None:
    trace_id, _, traceparent = caller()
    with httpx.stream(
        "POST",
        f"{traced.base_url}/v1/completions",
        json={
            "model": "m",
            "prompt": "Once",
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"traceparent": traceparent},
        timeout=60,
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    spans = trace_of(traced, receiver, trace_id)
    call = only(spans, "text_completion m")
    assert call.attributes["gen_ai.operation.name"] == "text_completion"
    assert call.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 16
    assert [name for name, _ in call.events] == ["gen_ai.first_token"], "one event, never one per token"
    first_token_at = call.events[0][1]
    assert call.start_ns < first_token_at < call.end_ns
    ttft = call.attributes["gen_ai.latency.time_to_first_token"]
    assert ttft == pytest.approx((first_token_at - call.start_ns) / 1e9, abs=1e-3)
    tpot = call.attributes["gen_ai.latency.time_per_output_token"]
    assert tpot == pytest.approx((call.end_ns - first_token_at) / 1e9 / 15, rel=0.05, abs=1e-5)
    assert only(spans, "POST /v1/completions").attributes["gen_ai.latency.time_to_first_token"] > 0
    prepare = only(spans, "engine.prepare_prompt")
    assert "gateway.prompt.tokenize_s" in prepare.attributes
    assert "gateway.prompt.render_s" not in prepare.attributes, "a text prompt is not rendered"


def test_a_caller_that_sampled_its_trace_out_gets_no_span(traced: RunningGateway, receiver: OTLPReceiver) -> None:
    trace_id, span_id, _ = caller()
    response = chat(
        traced.base_url, "m", {"traceparent": f"00-{trace_id}-{span_id}-00", "X-Request-ID": "sampled-out-1"}
    )
    assert response.status_code == 200
    assert trace_of(traced, receiver, trace_id) == []
    assert not [s for s in receiver.spans() if s.attributes.get("gateway.request_id") == "sampled-out-1"]


def test_a_request_without_trace_context_starts_a_trace_of_its_own(
    traced: RunningGateway, receiver: OTLPReceiver
) -> None:
    response = chat(traced.base_url, "m", {"X-Request-ID": "untraced-caller-1"})
    assert response.status_code == 200
    assert exported(traced)
    server = [s for s in receiver.spans() if s.attributes.get("gateway.request_id") == "untraced-caller-1"]
    assert len(server) == 1 and server[0].parent_span_id == ""
    assert {s.name for s in receiver.spans(server[0].trace_id)} >= {"gateway.route", "chat m"}


def test_the_responses_api_is_traced_through_the_same_hooks(traced: RunningGateway, receiver: OTLPReceiver) -> None:
    trace_id, parent_id, traceparent = caller()
    response = httpx.post(
        f"{traced.base_url}/v1/responses",
        json={"model": "m", "input": "Say hi.", "max_output_tokens": 4, "store": False},
        headers={"traceparent": traceparent},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    spans = trace_of(traced, receiver, trace_id)
    server = only(spans, "POST /v1/responses")
    assert server.parent_span_id == parent_id
    call = only(spans, "chat m")
    assert call.parent_span_id == server.span_id
    assert call.attributes["gen_ai.usage.output_tokens"] == response.json()["usage"]["output_tokens"]
    assert only(spans, "engine.prepare_prompt").parent_span_id == call.span_id


def test_a_client_error_is_a_server_span_with_its_error_type_and_nothing_below(
    traced: RunningGateway, receiver: OTLPReceiver
) -> None:
    trace_id, _, traceparent = caller()
    response = chat(traced.base_url, "no-such-model", {"traceparent": traceparent})
    assert response.status_code == 404
    (server,) = trace_of(traced, receiver, trace_id)
    assert server.attributes["http.response.status_code"] == 404
    assert server.attributes["error.type"] == response.json()["error"]["code"] == "model_not_found"
    assert not server.error, "a client's mistake is not the server's error"


def test_a_fallback_and_a_shadow_are_backend_calls_of_the_request_trace(
    traced: RunningGateway, receiver: OTLPReceiver
) -> None:
    hold = [{"role": "user", "content": "hold"}]
    body = {"model": "held", "messages": hold, "max_tokens": 500, "ignore_eos": True, "stream": True}  # 10 s
    with httpx.stream("POST", f"{traced.base_url}/v1/chat/completions", json=body, timeout=60) as holder:
        frames = holder.iter_lines()  # (kept: a dropped iterator closes the response)
        next(frames)  # its first frame: it holds busy's only slot until it is closed
        trace_id, _, traceparent = caller()
        response = chat(traced.base_url, "held", {"traceparent": traceparent}, max_tokens=3)
    assert response.status_code == 200 and response.headers["x-backend"] == "spare"
    spans = trace_of(traced, receiver, trace_id)
    server = only(spans, "POST /v1/chat/completions")
    assert server.attributes["gateway.backend"] == "spare"
    refused, rescued = (s for s in children(spans, server) if s.name == "chat held")
    assert refused.attributes["gateway.backend"] == "busy" and refused.error
    assert refused.attributes["error.type"] == "backend_saturated"
    assert refused.attributes["gateway.route.fallback"] == "spare"
    refusal = only(children(spans, refused), "gateway.admission")
    assert refusal.error and refusal.attributes["gateway.admission.admission"] == "queue_full"
    assert rescued.attributes["gateway.backend"] == "spare"
    assert rescued.attributes["gateway.route.via"] == "fallback" and not rescued.error

    mirror = traced.state.router.model_routes("mirrored").shadow
    assert mirror is not None
    trace_id, _, traceparent = caller()
    response = chat(traced.base_url, "mirrored", {"traceparent": traceparent}, max_tokens=3)
    assert response.status_code == 200
    assert wait_until(lambda: mirror.active == 0), "the shadow request did not end"
    spans = trace_of(traced, receiver, trace_id)
    server = only(spans, "POST /v1/chat/completions")
    assert only(spans, "gateway.route").attributes["gateway.route.shadow"] == "spare"
    calls = {s.attributes["gateway.route.via"]: s for s in children(spans, server) if s.name == "chat mirrored"}
    assert set(calls) == {"weighted", "shadow"}
    assert calls["shadow"].attributes["gateway.backend"] == "spare"
    assert calls["shadow"].attributes["gen_ai.usage.output_tokens"] == 3
    assert only(children(spans, calls["shadow"]), "engine.prepare_prompt")


def _dispatched(gateway: RunningGateway) -> dict[str, float]:
    text = httpx.get(f"{gateway.base_url}/metrics").text
    return {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_dp_rank_dispatched_requests_total" and sample.labels["backend"] == "ranked"
    }


def test_the_data_parallel_rank_that_served_a_request_is_on_its_backend_call(
    traced: RunningGateway, receiver: OTLPReceiver
) -> None:
    served = set()
    for prompt in ("one", "two"):  # idle ranks, short prompts: the balancer takes the ranks in turn
        before = _dispatched(traced)
        trace_id, _, traceparent = caller()
        response = chat(traced.base_url, "ranked", {"traceparent": traceparent}, content=prompt)
        assert response.status_code == 200
        after = _dispatched(traced)
        (rank,) = (int(rank) for rank in after if after[rank] > before.get(rank, 0))
        assert only(trace_of(traced, receiver, trace_id), "chat ranked").attributes["gateway.dp.rank"] == rank
        served.add(rank)
    assert served == {0, 1}


def _otel_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("OtelBatch")}


def test_with_tracing_off_nothing_is_started_and_nothing_exported(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    exports = receiver.exports
    threads = _otel_threads()
    # configured, and switched off the OpenTelemetry way
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    configured = GatewayConfig(server={"tracing": {"endpoint": receiver.endpoint}})
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    for config in (GatewayConfig(), configured):  # and not configured at all
        running = start_gateway(config)
        try:
            assert running.state.tracing is None
            assert _otel_threads() == threads, "an exporter thread was started"
            _, _, traceparent = caller()
            response = chat(running.base_url, "deepinfer-reference", {"traceparent": traceparent})
            assert response.status_code == 200
        finally:
            stop_gateway(running)
    assert receiver.exports == exports


def test_spans_still_queued_are_exported_when_the_gateway_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # ten minutes: only the shutdown can send them
    with OTLPReceiver() as receiver:
        running = start_gateway(GatewayConfig(server={"tracing": {"endpoint": receiver.endpoint}}))
        trace_id, _, traceparent = caller()
        try:
            response = chat(running.base_url, "deepinfer-reference", {"traceparent": traceparent})
            assert response.status_code == 200
            assert receiver.spans(trace_id) == []
        finally:
            stop_gateway(running)
        assert {s.name for s in receiver.spans(trace_id)} >= {"POST /v1/chat/completions", "chat deepinfer-reference"}


def test_each_front_end_process_exports_its_requests_and_flushes_them_on_sigterm(
    receiver: OTLPReceiver, tmp_path: Path
) -> None:
    port = free_port()
    config: dict[str, Any] = {
        "server": {"http": {"port": port}, "runtime": {"workers": 2}, "tracing": {"endpoint": receiver.endpoint}},
        "backends": [{"name": "reference", "kind": "reference"}],
        "models": [{"name": "m", "backends": ["reference"]}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # nothing goes out before the drain
    with (tmp_path / "supervisor.log").open("wb") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        assert wait_until(lambda: len(front_ends(supervisor.pid)) == 2, timeout=60)
        assert wait_until(lambda: is_ready(base), timeout=180)
        pids = front_ends(supervisor.pid)
        traces = []
        for _ in range(8):  # new connections: the kernel spreads them over both processes
            trace_id, _, traceparent = caller()
            traces.append(trace_id)
            response = chat(base, "m", {"traceparent": traceparent})
            assert response.status_code == 200
        assert not any(receiver.spans(trace_id) for trace_id in traces)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=120) == 0
        for trace_id in traces:
            (server,) = (s for s in receiver.spans(trace_id) if s.kind == "server")
            assert server.resource["process.pid"] in pids
        ours = [s for trace_id in traces for s in receiver.spans(trace_id)]
        instances = {s.resource["process.pid"]: s.resource["service.instance.id"] for s in ours}
        assert len(set(instances.values())) == len(instances), "each process is its own service instance"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()

"""Overload, timeouts, engine failures and slow clients: the gateway answers cleanly and loses nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from backends.config import ReferenceBackendConfig
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import ChatPrompt, EngineBackend, OutputParser
from backends.interface import GenerateRequest, SamplingOptions, ToolCallDelta
from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs
from gateway.admission import AdmittedBackend
from gateway.config import GatewayConfig
from gateway.flow_control import FlowController, tier_bounds

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway, wait_until
from ..processes import free_port

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "ignore_eos": True}


def _one_backend(**backend: Any) -> GatewayConfig:
    return GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", **backend}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )


@pytest.fixture(scope="module")
def narrow() -> Iterator[RunningGateway]:
    """One slot, one queue place, a short queue timeout and slow decoding: easy to saturate."""
    config = _one_backend(max_in_flight=1, max_queue=1, queue_timeout=0.5, timing={"decode_seconds_per_step": 0.01})
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_saturated_backend_answers_503_with_retry_after_and_never_queues_unboundedly(narrow: RunningGateway) -> None:
    gate = narrow.state.backends["reference"].gate  # type: ignore[attr-defined]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=narrow.base_url, timeout=30) as client:
            body = {**LONG, "max_tokens": 200}
            running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            assert await asyncio.to_thread(wait_until, lambda: gate.in_flight == 1)
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            assert await asyncio.to_thread(wait_until, lambda: gate.queued == 1)
            rejected = await client.post("/v1/chat/completions", json=body)
            return [rejected, await queued, await running]

    rejected, queued, running = asyncio.run(scenario())
    assert running.status_code == 200
    assert rejected.status_code == 503
    assert rejected.json()["error"]["code"] == "backend_saturated"
    assert int(rejected.headers["retry-after"]) >= 1
    assert queued.status_code == 503, "the queued request waited its queue_timeout (0.5 s) and was then refused"
    assert wait_until(lambda: narrow.engine_unfinished() == 0)
    metrics = httpx.get(f"{narrow.base_url}/metrics").text
    assert 'gateway_admission_rejected_total{backend="reference"} 2.0' in metrics
    assert 'gateway_admission_queued{backend="reference"} 0.0' in metrics


@pytest.fixture(scope="module")
def deadline_gateway() -> Iterator[RunningGateway]:
    config = _one_backend(timing={"decode_seconds_per_step": 0.01})
    config.server.streams.request_timeout = 0.5
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_request_past_its_deadline_gets_504_and_its_engine_work_is_aborted(deadline_gateway: RunningGateway) -> None:
    response = httpx.post(f"{deadline_gateway.base_url}/v1/chat/completions", json=LONG, timeout=30)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert wait_until(lambda: deadline_gateway.engine_unfinished() == 0)


def test_stream_past_its_deadline_ends_with_an_error_frame_and_done(deadline_gateway: RunningGateway) -> None:
    with httpx.stream(
        "POST", f"{deadline_gateway.base_url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=30
    ) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert orjson.loads(data[-2])["error"]["code"] == "timeout"
    assert len(data) > 3, "tokens flowed before the deadline"
    assert wait_until(lambda: deadline_gateway.engine_unfinished() == 0)


def test_no_first_token_within_the_idle_timeout_gets_504() -> None:
    config = _one_backend(timing={"prefill_seconds_per_token": 0.2})
    config.server.streams.idle_timeout = 0.3
    running = start_gateway(config)
    try:
        with captured_logs(running) as logs:
            response = httpx.post(f"{running.base_url}/v1/chat/completions", json=LONG, timeout=30)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout"
        (line,) = [line for line in logs if line.get("event") == "request" and line.get("path") != "/ready"]
        assert "No output" in line["error_detail"], "the log says which deadline"
        assert wait_until(lambda: running.engine_unfinished() == 0 and running.driver_in_flight() == 0)
    finally:
        stop_gateway(running)


def test_a_whole_response_may_outlast_the_idle_timeout_while_its_tokens_keep_coming() -> None:
    """The idle timeout bounds the gap between two tokens, not how long a non-streamed response takes: 15 steps
    of 0.1 s make 1.5 s, past an idle timeout of 1 s, and the answer is whole."""
    config = _one_backend(timing={"decode_seconds_per_step": 0.1})
    config.server.streams.idle_timeout = 1.0
    running = start_gateway(config)
    try:
        response = httpx.post(f"{running.base_url}/v1/chat/completions", json={**LONG, "max_tokens": 15}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 15
    finally:
        stop_gateway(running)


def test_a_stream_may_outlast_the_idle_timeout_while_its_tokens_keep_coming() -> None:
    """The same for a stream, whose frames are written as the steps come while its task waits: each frame written
    restarts the idle timeout, so 15 steps of 0.1 s past an idle timeout of 1 s end well, with no timeout frame."""
    config = _one_backend(timing={"decode_seconds_per_step": 0.1})
    config.server.streams.idle_timeout = 1.0
    running = start_gateway(config)
    try:
        body = {**LONG, "max_tokens": 15, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [orjson.loads(d) for d in data[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        assert chunks[-1]["usage"]["completion_tokens"] == 15
    finally:
        stop_gateway(running)


class CrashingEngine(ReferenceEngine):
    """Test double: the reference engine, whose ``step()`` raises once the test arms it."""

    armed = threading.Event()

    def step(self):  # type: ignore[no-untyped-def]
        if self.armed.is_set():
            raise RuntimeError("injected engine fault")
        return super().step()


def test_engine_crash_fails_its_requests_cleanly_and_leaves_other_backends_serving() -> None:
    def crashing() -> CrashingEngine:
        return CrashingEngine.from_engine_args(ReferenceEngineArgs(decode_seconds_per_step=0.01))  # type: ignore[return-value]

    crash_backend = EngineBackend("fragile", "reference", crashing, DeepSeekV41ChatTemplate())
    healthy_config = ReferenceBackendConfig(name="healthy")
    from backends.registry import build_backend

    config = GatewayConfig(
        backends=[{"name": "fragile", "kind": "reference"}, {"name": "healthy", "kind": "reference"}],
        models=[{"name": "fragile-model", "backends": ["fragile"]}, {"name": MODEL, "backends": ["healthy"]}],
    )
    running = start_gateway(config, backends={"fragile": crash_backend, "healthy": build_backend(healthy_config)})
    try:
        url = f"{running.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json={**LONG, "model": "fragile-model", "stream": True}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            CrashingEngine.armed.set()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = orjson.loads(rest[-2])["error"]
        assert error["type"] == "server_error"
        assert "injected" not in error["message"] and stream.headers["x-request-id"] in error["message"]
        ready = httpx.get(f"{running.base_url}/ready")
        assert ready.status_code == 503
        assert "injected engine fault" in ready.json()["backends"]["fragile"]["reason"]
        refused = httpx.post(url, json={**LONG, "model": "fragile-model", "max_tokens": 2})
        assert refused.status_code == 503
        served = httpx.post(url, json={**LONG, "max_tokens": 3}, timeout=30)
        assert served.status_code == 200, "the other backend and the process stay up"
    finally:
        CrashingEngine.armed.clear()
        stop_gateway(running)


def test_server_errors_show_a_generic_message_and_the_request_id_and_log_the_detail() -> None:
    """A dead upstream's URL and connection error are the operator's: the client gets a generic 503."""
    dead = f"http://127.0.0.1:{free_port()}"
    config = GatewayConfig(
        backends=[{"name": "dead", "kind": "lmdeploy", "urls": [dead], "health_interval": 0.2}],
        models=[{"name": "gone", "backends": ["dead"]}],
    )
    running = start_gateway(config, wait_for="/health")
    try:
        body = {"model": "gone", "messages": [{"role": "user", "content": "hi"}]}
        with captured_logs(running) as logs:
            refused = httpx.post(f"{running.base_url}/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 503
        request_id = refused.headers["x-request-id"]
        error = refused.json()["error"]
        assert error == {
            "message": f"The model is not available right now; retry later. (request id {request_id})",
            "type": "server_error",
            "param": None,
            "code": error["code"],
        }
        assert "127.0.0.1" not in refused.text and "dead" not in refused.text
        (line,) = [line for line in logs if line.get("event") == "request" and line["request_id"] == request_id]
        assert dead in line["error_detail"] or "dead" in line["error_detail"], "the detail goes to the log"
    finally:
        stop_gateway(running)


def test_a_client_that_stops_reading_does_not_stall_other_streams(timed_gateway: RunningGateway) -> None:
    import socket

    host, port = timed_gateway.base_url.removeprefix("http://").split(":")
    before = timed_gateway.engine_tokens()
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = orjson.dumps({**LONG, "max_tokens": 3000, "stream": True})
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    try:
        for _ in range(3):
            url = f"{timed_gateway.base_url}/v1/chat/completions"
            reply = httpx.post(url, json={**LONG, "max_tokens": 50}, timeout=30)
            assert reply.status_code == 200
    finally:
        stalled.close()
    assert wait_until(timed_gateway.engine_idle, timeout=30)
    assert timed_gateway.engine_tokens() - before < 3000, "the stalled stream was aborted when its client left"


class FaultyParser:
    """Test double: the model family's output parser, failing with a bug (not a backend error) on its third step."""

    def __init__(self, inner: OutputParser) -> None:
        self._inner = inner
        self._pushes = 0

    @property
    def in_reasoning(self) -> bool:
        return self._inner.in_reasoning

    @property
    def called(self) -> bool:
        return self._inner.called

    @property
    def matched_stop(self) -> str | None:
        return self._inner.matched_stop

    @property
    def drops_leading_newlines(self) -> bool:
        return self._inner.drops_leading_newlines

    def push(self, text: str) -> tuple[str, str, Sequence[ToolCallDelta]]:
        self._pushes += 1
        if self._pushes == 3:
            raise RuntimeError("injected parser bug")
        return self._inner.push(text)

    def finish(self) -> tuple[str, str, Sequence[ToolCallDelta]]:
        return self._inner.finish()


class FaultyTemplate(DeepSeekV41ChatTemplate):
    """The DeepSeek V4.1 chat template, whose parsers are ``FaultyParser``s."""

    def render(self, request: GenerateRequest, tokenizer: Tokenizer) -> ChatPrompt:
        prompt = super().render(request, tokenizer)
        inner = prompt.parser
        assert inner is not None
        return prompt._replace(parser=lambda *, stops: FaultyParser(inner(stops=stops)))


def test_any_failure_after_the_first_frame_ends_the_stream_with_an_error_frame_and_done() -> None:
    def engine() -> ReferenceEngine:
        return ReferenceEngine.from_engine_args(ReferenceEngineArgs(decode_seconds_per_step=0.002))

    faulty = EngineBackend("reference", "reference", engine, FaultyTemplate())
    running = start_gateway(_one_backend(), backends={"reference": faulty})
    try:
        before = running.engine_tokens()
        url = f"{running.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = orjson.loads(data[-2])["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        assert "injected" not in error["message"], "a bug's details stay in the log"
        assert len(data) >= 3, "frames flowed before the failure"
        assert wait_until(running.engine_idle)
        assert running.engine_tokens() - before < 2000, "the engine request was aborted"
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert 'gateway_requests_total{backend="reference",model="deepinfer-reference",status="500"} 1.0' in metrics
        assert 'code="internal_error"' in metrics
    finally:
        stop_gateway(running)


async def test_an_admitted_request_aborts_its_engine_work_before_it_frees_its_slot() -> None:
    def engine() -> ReferenceEngine:
        return ReferenceEngine.from_engine_args(ReferenceEngineArgs(decode_seconds_per_step=0.002))

    backend = EngineBackend("reference", "reference", engine, DeepSeekV41ChatTemplate())
    await backend.start()
    try:
        seen: list[int] = []
        gate = FlowController("reference", 4, tier_bounds(None))
        release = gate.release

        def recording_release(seconds: float) -> None:  # what the engine driver still holds when the slot frees
            seen.append(backend.driver.in_flight)
            release(seconds)

        gate.release = recording_release  # type: ignore[method-assign]
        request = GenerateRequest(
            request_id="aclose",
            model=MODEL,
            messages=[{"role": "user", "content": "go"}],
            sampling=SamplingOptions(max_tokens=2000, ignore_eos=True),
        )
        events = AdmittedBackend(backend, gate).generate(request)
        await anext(events)
        await events.aclose()
        assert seen == [0], "the engine request was aborted before the slot was released"
    finally:
        await backend.stop()

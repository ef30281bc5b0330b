"""End to end: the gateway's HTTP API with the openai SDK, served by a ``deepinfer`` backend whose ``import deepinfer``
resolves to the TEST DOUBLE. The double's "model" echoes the prompt's text, so outputs are known exactly."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig

from ...conformance import OpenAISchemas
from ...conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from .conftest import MAX_MODEL_LEN, OUT_OF_VOCAB_TOKEN, deepinfer_on_path

MODEL = "deepseek-v4.1"
FINGERPRINT = "fp_deepinfer-0.1.0+testdouble-batch_invariant_off"


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[RunningGateway]:
    with deepinfer_on_path():
        config = GatewayConfig(
            backends=[
                {
                    "name": "deepinfer",
                    "kind": "deepinfer",
                    "model": str(model_dir),
                    "max_model_len": MAX_MODEL_LEN,
                    "env": {"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"},
                }
            ],
            models=[{"name": MODEL, "backends": ["deepinfer"]}],
        )
        running = start_gateway(config)
        yield running
        stop_gateway(running)


@pytest.fixture(scope="module")
def client(served: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def idle(served: RunningGateway) -> bool:
    return served.engine_unfinished("deepinfer") == 0 and served.driver_in_flight("deepinfer") == 0


def test_ready_reports_the_deepinfer_backend(served: RunningGateway) -> None:
    ready = httpx.get(f"{served.base_url}/ready").json()
    assert ready["backends"]["deepinfer"] == {
        "kind": "deepinfer",
        "ready": True,
        "reason": "ready",
        "circuits": {MODEL: "closed"},
    }


def test_completion_text_stops_at_eos_without_showing_it(client: openai.OpenAI, schemas: OpenAISchemas) -> None:
    reply = client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=50)
    schemas.check("CreateCompletionResponse", reply.model_dump(mode="json", exclude_unset=True))
    assert reply.choices[0].text == "alpha beta gamma"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.system_fingerprint == FINGERPRINT


def test_streamed_completion_carries_the_same_text(client: openai.OpenAI, schemas: OpenAISchemas) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="one two three four", max_tokens=50, stream=True))
    for chunk in chunks:
        schemas.check_completion_chunk(chunk.model_dump(mode="json", exclude_unset=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "one two three four"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_uses_the_deepseek_prompt_and_the_rest_of_the_context_by_default(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello double"}],
        extra_body={"ignore_eos": True, "thinking": {"type": "disabled"}},
    )
    assert reply.choices[0].message.content.startswith("hello double")
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == MAX_MODEL_LEN, "not DeepInfer's 16"
    assert reply.system_fingerprint == FINGERPRINT


def test_chat_thinks_at_effort_high_by_default_as_deepseek_serves_v41(client: openai.OpenAI) -> None:
    """The double writes the prompt back: a request that says nothing about thinking reasons over V4.1's thinking
    prompt with effort high (75), as reasoning_content."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello double"}], max_tokens=40
    )
    reasoning = reply.choices[0].message.model_extra.get("reasoning_content")  # type: ignore[union-attr]
    assert reasoning is not None and reasoning.startswith("Reasoning Effort: 75 (range 1-100")


def test_logprobs_come_from_the_engine_outputs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == [-0.25, -0.5, -0.75]  # the double's pattern, by position
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_prompt_logprobs_come_from_get_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = [0, 300, 301, 302, 303]
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and scored.usage is not None and scored.usage.completion_tokens == 0
    assert logprobs.token_logprobs == [None, -0.125, -0.25, -0.375, -0.5]  # the double's pattern, by position
    both = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1, extra_body={"ignore_eos": True}
    )
    assert both.choices[0].logprobs is not None
    assert both.choices[0].logprobs.token_logprobs == [None, -0.125, -0.25, -0.375, -0.5, -0.25, -0.5]


def test_stop_string_ends_the_stream_and_aborts_the_engine_request(
    served: RunningGateway, client: openai.OpenAI
) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="alpha beta gamma delta", max_tokens=100, stop=[" gamma"], extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text == "alpha beta"
    assert reply.choices[0].finish_reason == "stop"
    assert wait_until(lambda: idle(served))


def test_client_disconnect_aborts_the_engine_request(served: RunningGateway) -> None:
    from deepinfer._double import STEP_GATE

    llm = unwrapped(served.state.backends["deepinfer"]).driver.engine.llm_engine  # type: ignore[attr-defined]
    aborted_before = llm.scheduler.get_num_aborted_seqs()
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 200, "stream": True, "ignore_eos": True}
    STEP_GATE.clear()  # the engine holds in step(): the request is inside the engine, nothing streamed yet
    try:
        host, port = served.base_url.removeprefix("http://").split(":")
        payload = orjson.dumps(body)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            assert wait_until(lambda: served.driver_in_flight("deepinfer") == 1)
        assert wait_until(lambda: served.driver_in_flight("deepinfer") == 0)
    finally:
        STEP_GATE.set()
    assert wait_until(lambda: idle(served))
    assert llm.scheduler.get_num_aborted_seqs() == aborted_before + 1


def test_prompt_with_ids_outside_the_model_vocabulary_is_a_400(served: RunningGateway, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        client.completions.create(model=MODEL, prompt=f"look {OUT_OF_VOCAB_TOKEN}", max_tokens=5)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=5)
    assert raised.value.code == "invalid_token_id"
    assert wait_until(lambda: idle(served))


def test_too_long_prompt_is_a_context_length_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=1)
    assert raised.value.code == "context_length_exceeded"


def test_metrics_export_engine_statistics(served: RunningGateway, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="count these words please", max_tokens=30)
    label = '{backend="deepinfer"}'
    gauges = ("running_requests", "waiting_requests", "kv_cache_usage_ratio")

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{served.base_url}/metrics").text
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith("gateway_engine_") and 'backend="deepinfer"' in line
        }

    def gauges_at_zero() -> bool:
        samples = scrape()
        return all(samples[f"gateway_engine_{gauge}{label}"] == 0 for gauge in gauges)

    # The gauges are the engine's as of its last step, and the step that retires a finished request comes after
    # the one that returned its last output (which the client may already have): idle, they all come back to 0.
    assert wait_until(gauges_at_zero), scrape()
    samples = scrape()
    assert f"gateway_engine_preempted_requests_total{label}" in samples
    assert f"gateway_engine_aborted_requests_total{label}" in samples
    drafted = samples[f"gateway_engine_spec_decode_draft_tokens_total{label}"]
    accepted = samples[f"gateway_engine_spec_decode_accepted_tokens_total{label}"]
    assert 0 < accepted <= drafted
    assert samples[f"gateway_engine_spec_decode_drafts_total{label}"] * 5 == drafted  # DSpark: 5 drafts per step

"""End to end on DeepInfer's real engine: the gateway's HTTP API with the openai SDK, one rank in process (two
data-parallel ranks: ``test_data_parallel.py``). The stub model echoes the prompt, so outputs are known exactly."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import GatewayConfig

from ....conftest import RunningGateway, start_gateway, stop_gateway, wait_until
from ..conftest import MAX_MODEL_LEN, OUT_OF_VOCAB_TOKEN
from .conftest import ENGINE_ENV

MODEL = "deepseek-v4.1"
FINGERPRINT = "fp_deepinfer-0.1.0-batch_invariant_off"


def gateway_config(model_dir: Path, **backend: object) -> GatewayConfig:
    return GatewayConfig(
        backends=[
            {
                "name": "deepinfer",
                "kind": "deepinfer",
                "model": str(model_dir),
                "max_model_len": MAX_MODEL_LEN,
                "max_num_seqs": 16,
                "env": {**ENGINE_ENV, "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1"},
                **backend,
            }
        ],
        models=[{"name": MODEL, "backends": ["deepinfer"]}],
    )


@pytest.fixture(scope="module")
def served(real_model_dir: Path) -> Iterator[RunningGateway]:
    saved = dict(os.environ)  # the engine sets its variables process-wide (its MASTER_PORT among them)
    running = start_gateway(gateway_config(real_model_dir))
    yield running
    stop_gateway(running)
    os.environ.clear()
    os.environ.update(saved)


def client_of(served: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def idle(served: RunningGateway) -> bool:
    return served.engine_unfinished("deepinfer") == 0 and served.driver_in_flight("deepinfer") == 0


def test_completion_text_stops_at_eos_without_showing_it(served: RunningGateway) -> None:
    reply = client_of(served).completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=50)
    assert reply.choices[0].text == "alpha beta gamma"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.system_fingerprint == FINGERPRINT
    assert reply.usage is not None
    assert reply.usage.completion_tokens == reply.usage.prompt_tokens, "the prompt after its BOS, then EOS"


def test_streamed_completion_carries_the_same_text(served: RunningGateway) -> None:
    chunks = list(
        client_of(served).completions.create(model=MODEL, prompt="one two three four", max_tokens=50, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "one two three four"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_length_limit_ends_with_length(served: RunningGateway) -> None:
    reply = client_of(served).completions.create(model=MODEL, prompt="one two three four", max_tokens=2)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("one two", "length")


def test_stop_string_ends_the_request_and_aborts_it_in_the_engine(served: RunningGateway) -> None:
    reply = client_of(served).completions.create(
        model=MODEL, prompt="alpha beta gamma delta", max_tokens=100, stop=[" gamma"], extra_body={"ignore_eos": True}
    )
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("alpha beta", "stop")
    assert wait_until(lambda: idle(served))


def test_prompt_with_ids_outside_the_model_vocabulary_is_a_400(served: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        client_of(served).completions.create(model=MODEL, prompt=f"look {OUT_OF_VOCAB_TOKEN}", max_tokens=5)
    assert wait_until(lambda: idle(served))


def test_metrics_export_the_real_schedulers_statistics(served: RunningGateway) -> None:
    client_of(served).completions.create(model=MODEL, prompt="count these words please", max_tokens=30)
    assert wait_until(lambda: idle(served))
    text = httpx.get(f"{served.base_url}/metrics").text
    label = '{backend="deepinfer"}'
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if label in line}
    assert samples[f"gateway_engine_running_requests{label}"] == 0
    assert samples[f"gateway_engine_kv_cache_usage_ratio{label}"] == 0

"""Prompts are prepared on the backend's pool: the event loop and the engine thread never wait for a huge prompt."""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import ChatPrompt, EngineBackend
from backends.interface import GenerateRequest
from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs
from backends.reference.structured import StructuredOutputs
from gateway.config import GatewayConfig

from ..conftest import MODEL, TINY_CONTEXT, TINY_MODEL, start_gateway, stop_gateway

GATE_SECONDS = 60.0
"""Only a safety net: a test that never releases its gate fails instead of hanging."""


class GatedChatTemplate:
    """Test double around the real DeepSeek V4.1 template: ``render`` first waits at a gate the test opens, so a
    prompt stays "in preparation" for as long as the test needs to look at the gateway meanwhile."""

    features = DeepSeekV41ChatTemplate.features
    output_markers = DeepSeekV41ChatTemplate.output_markers

    def __init__(self) -> None:
        self._real = DeepSeekV41ChatTemplate()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: list[str] = []

    def render(self, request: GenerateRequest, tokenizer: Tokenizer) -> ChatPrompt:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if not self.gate.wait(GATE_SECONDS):
            raise RuntimeError("the test never opened the gate")
        return self._real.render(request, tokenizer)


def test_health_answers_while_a_huge_prompt_is_being_prepared() -> None:
    template = GatedChatTemplate()
    max_model_len = 65_536

    def engine() -> ReferenceEngine:
        return ReferenceEngine.from_engine_args(ReferenceEngineArgs(max_model_len=max_model_len))

    backend = EngineBackend("reference", "reference", engine, template, prepare_threads=2)
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference"}], models=[{"name": MODEL, "backends": ["reference"]}]
    )
    running = start_gateway(config, backends={"reference": backend})
    huge = "the big prompt goes on " * 4000  # ~92k characters, ~20k tokens: fits the context
    body = {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}
    try:
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=running.base_url, timeout=GATE_SECONDS) as http:
            pending = pool.submit(http.post, "/v1/chat/completions", json=body)
            assert template.entered.wait(GATE_SECONDS), "the prompt never reached preparation"
            health = httpx.get(f"{running.base_url}/health", timeout=10)
            assert health.status_code == 200
            assert not pending.done(), "the chat request was still being prepared while /health answered"
            template.gate.set()
            response = pending.result(timeout=GATE_SECONDS)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] > 10_000
        assert template.threads and all(name.startswith("prepare-reference") for name in template.threads)
    finally:
        template.gate.set()
        stop_gateway(running)


@pytest.fixture
def compile_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads on which the reference engine compiled a grammar during the test."""
    threads: list[str] = []
    build = StructuredOutputs._build

    def recording_build(self: StructuredOutputs, schema_type: str, schema: str) -> Any:
        threads.append(threading.current_thread().name)
        return build(self, schema_type, schema)

    monkeypatch.setattr(StructuredOutputs, "_build", recording_build)
    return threads


def test_grammars_are_compiled_on_the_preparation_pool_not_the_engine_thread(
    client: openai.OpenAI, compile_threads: list[str]
) -> None:
    field = f"f_{uuid.uuid4().hex[:8]}"  # a schema no other test compiled, so the grammar cache cannot answer
    schema = {"type": "object", "properties": {field: {"enum": ["yes", "no"]}}, "required": [field]}
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "yes or no?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=64,
        n=2,
    )
    for choice in response.choices:
        assert json.loads(choice.message.content or "")[field] in ("yes", "no")
    assert compile_threads, "no grammar was compiled"
    assert all(name.startswith("prepare-reference") for name in compile_threads), compile_threads


def test_tool_call_grammar_is_compiled_off_the_engine_thread_too(
    client: openai.OpenAI, compile_threads: list[str]
) -> None:
    name = f"tool_{uuid.uuid4().hex[:8]}"
    tool = {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "call it"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=128,
    )
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == name  # type: ignore[union-attr]
    assert compile_threads and all(n.startswith("prepare-reference") for n in compile_threads), compile_threads


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_prompt_that_cannot_fit_the_context_is_refused_with_400(http: httpx.Client, route: str) -> None:
    text = "x" * (TINY_CONTEXT * 64)  # more characters than TINY_CONTEXT tokens could ever cover
    if route == "chat":
        response = http.post(
            "/v1/chat/completions", json={"model": TINY_MODEL, "messages": [{"role": "user", "content": text}]}
        )
        param = "messages"
    else:
        response = http.post("/v1/completions", json={"model": TINY_MODEL, "prompt": text})
        param = "prompt"
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    assert f"maximum context length is {TINY_CONTEXT} tokens" in error["message"]

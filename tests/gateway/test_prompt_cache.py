"""Cache-hit usage: every API reports the prompt tokens the engine found in its prefix cache, exactly as the engine
counted them (its own counters are the reference), streamed and not, in process and over the rank wire."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from backends.reference.engine import ReferenceEngine
from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig

from ..anthropic_conformance import ConformingTransport as AnthropicConformingTransport
from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_for_requests_done, wait_until
from ..responses_conformance import ConformingTransport as ResponsesConformingTransport

BLOCK = 16
SYSTEM = (
    "You are the archivist of a small harbour town. You answer questions about its ships, its tides, its lighthouse "
    "and the families who kept it, in plain sentences, and you say so when the records do not know."
)
"""Long enough for several cache blocks, so a repeated conversation has a prefix to hit."""
PREFIX_CACHE = {"prefix_cache_tokens": 4096 * BLOCK, "prefix_cache_block_size": BLOCK}


@pytest.fixture(scope="module")
def cache_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference", **PREFIX_CACHE}, {"name": "plain", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}, {"name": "no-cache", "backends": ["plain"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def client(cache_gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cache_gateway.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(transport=ResponsesConformingTransport()),
    )


@pytest.fixture(scope="module")
def claude(cache_gateway: RunningGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=cache_gateway.base_url,
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx2.Client(transport=AnthropicConformingTransport()),
    )


def engine_of(gateway: RunningGateway, backend: str = "reference") -> ReferenceEngine:
    engine = unwrapped(gateway.state.backends[backend]).driver.engine  # type: ignore[attr-defined]
    assert isinstance(engine, ReferenceEngine)
    return engine


def engine_hits(gateway: RunningGateway, call: Callable[[], Any]) -> tuple[Any, int]:
    """What ``call`` returned, and the prompt tokens the engine found in its prefix cache meanwhile."""
    engine = engine_of(gateway)
    before = engine.prefix_cache_hit_tokens
    result = call()
    wait_for_requests_done(gateway)
    return result, engine.prefix_cache_hit_tokens - before


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def openai_cache(usage: Any) -> tuple[int, int, int]:
    """(OpenAI's cached tokens, DeepSeek's hits, DeepSeek's misses), checking they make the prompt."""
    extra = usage.model_extra
    hits, misses = extra["prompt_cache_hit_tokens"], extra["prompt_cache_miss_tokens"]
    assert hits + misses == usage.prompt_tokens
    return usage.prompt_tokens_details.cached_tokens, hits, misses


def test_chat_reports_the_engines_cache_hits_and_nothing_more(
    cache_gateway: RunningGateway, client: openai.OpenAI
) -> None:
    ask = lambda: client.chat.completions.create(model=MODEL, messages=chat("Who kept the light?"), max_tokens=4)  # noqa: E731
    cold, cold_hits = engine_hits(cache_gateway, ask)
    assert openai_cache(cold.usage) == (cold_hits, cold_hits, cold.usage.prompt_tokens - cold_hits)
    warm, warm_hits = engine_hits(cache_gateway, ask)
    assert warm_hits >= BLOCK and warm_hits % BLOCK == 0  # the system prompt and the question, in whole blocks
    assert openai_cache(warm.usage) == (warm_hits, warm_hits, warm.usage.prompt_tokens - warm_hits)


def test_streamed_chat_and_completions_report_the_engines_cache_hits(
    cache_gateway: RunningGateway, client: openai.OpenAI
) -> None:
    def streamed_chat() -> Any:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=chat("When was the harbour wall built?"),
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk.usage for chunk in stream if chunk.usage is not None][-1]

    engine_hits(cache_gateway, streamed_chat)
    usage, hits = engine_hits(cache_gateway, streamed_chat)
    assert hits >= BLOCK and openai_cache(usage) == (hits, hits, usage.prompt_tokens - hits)

    prompt = SYSTEM + " Tell me about the tides."
    complete = lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)  # noqa: E731
    engine_hits(cache_gateway, complete)
    completion, hits = engine_hits(cache_gateway, complete)
    assert hits >= BLOCK and openai_cache(completion.usage) == (hits, hits, completion.usage.prompt_tokens - hits)


def test_a_conversations_next_turn_hits_its_earlier_turns(cache_gateway: RunningGateway, client: openai.OpenAI) -> None:
    first = chat("Which ship sank in the storm?")
    answer, first_hits = engine_hits(
        cache_gateway, lambda: client.chat.completions.create(model=MODEL, messages=first, max_tokens=8)
    )
    second = [
        *first,
        {"role": "assistant", "content": "The records name the Heron."},
        {"role": "user", "content": "Why?"},
    ]
    reply, hits = engine_hits(
        cache_gateway, lambda: client.chat.completions.create(model=MODEL, messages=second, max_tokens=4)
    )
    assert hits >= answer.usage.prompt_tokens - first_hits - BLOCK  # the first turn's prompt, but its last block
    assert openai_cache(reply.usage) == (hits, hits, reply.usage.prompt_tokens - hits)


def test_responses_report_the_engines_cache_hits(cache_gateway: RunningGateway, client: openai.OpenAI) -> None:
    def respond() -> Any:
        return client.responses.create(
            model=MODEL, instructions=SYSTEM, input="Where did the ferry go?", max_output_tokens=4, store=False
        )

    engine_hits(cache_gateway, respond)
    response, hits = engine_hits(cache_gateway, respond)
    usage = response.usage
    assert hits >= BLOCK and usage.input_tokens_details.cached_tokens == hits
    assert usage.model_extra == {"prompt_cache_hit_tokens": hits, "prompt_cache_miss_tokens": usage.input_tokens - hits}

    def respond_streamed() -> Any:
        stream = client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input="Where did the ferry go?",
            max_output_tokens=4,
            store=False,
            stream=True,
        )
        return [e.response for e in stream if e.type in ("response.completed", "response.incomplete")][-1]

    streamed, hits = engine_hits(cache_gateway, respond_streamed)
    assert hits >= BLOCK and streamed.usage.input_tokens_details.cached_tokens == hits


def test_messages_report_the_engines_cache_hits_as_cache_reads(
    cache_gateway: RunningGateway, claude: anthropic.Anthropic
) -> None:
    def ask() -> Any:
        return claude.messages.create(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Who painted the lighthouse?"}],
            max_tokens=4,
        )

    cold, cold_hits = engine_hits(cache_gateway, ask)
    assert cold.usage.cache_read_input_tokens == cold_hits
    message, hits = engine_hits(cache_gateway, ask)
    assert hits >= BLOCK and message.usage.cache_read_input_tokens == hits
    # Anthropic's input_tokens leave the cache reads out: together they are the prompt the cold request reported.
    assert message.usage.input_tokens + hits == cold.usage.input_tokens + cold_hits

    def ask_streamed() -> Any:
        with claude.messages.stream(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Who painted the lighthouse?"}],
            max_tokens=4,
        ) as stream:
            return stream.get_final_message()

    streamed, hits = engine_hits(cache_gateway, ask_streamed)
    assert hits >= BLOCK and streamed.usage.cache_read_input_tokens == hits


def test_an_engine_without_a_prefix_cache_reports_no_hits(cache_gateway: RunningGateway, client: openai.OpenAI) -> None:
    for _ in range(2):
        reply = client.chat.completions.create(model="no-cache", messages=chat("Who kept the light?"), max_tokens=4)
        assert openai_cache(reply.usage) == (0, 0, reply.usage.prompt_tokens)
    assert engine_of(cache_gateway, "plain").prefix_cache_hit_tokens == 0


def test_metrics_count_the_engines_hits_by_model_and_backend(
    cache_gateway: RunningGateway, client: openai.OpenAI
) -> None:
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=chat("How deep is the channel?"), max_tokens=4)
    wait_for_requests_done(cache_gateway)
    engine = engine_of(cache_gateway)
    assert engine.prefix_cache_hit_tokens > 0
    assert (
        cache_gateway.metric("gateway_prompt_cache_hit_tokens_total", model=MODEL, backend="reference")
        == cache_gateway.metric("gateway_engine_prefix_cache_hit_tokens_total", backend="reference")
        == engine.prefix_cache_hit_tokens
    )
    assert (
        cache_gateway.metric("gateway_engine_prefix_cache_queried_tokens_total", backend="reference")
        == engine.prefix_cache_queried_tokens
    )


def test_hits_cross_the_rank_wire_as_the_ranks_counted_them() -> None:
    config = GatewayConfig(
        backends=[{"name": "dp", "kind": "reference", "data_parallel_size": 2, **PREFIX_CACHE}],
        models=[{"name": MODEL, "backends": ["dp"]}],
    )
    gateway = start_gateway(config)
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        reported = 0
        for _ in range(3):
            reply = client.chat.completions.create(model=MODEL, messages=chat("Who kept the light?"), max_tokens=4)
            reported += openai_cache(reply.usage)[1]
        assert reported >= 2 * BLOCK  # the ranks' balancer sends a repeated prefix back to the rank that holds it

        def ranks_hits() -> float:
            return gateway.metric("gateway_dp_rank_engine_prefix_cache_hit_tokens_total", backend="dp")

        assert wait_until(lambda: ranks_hits() == reported), (ranks_hits(), reported)  # ranks report every second
        assert gateway.metric("gateway_prompt_cache_hit_tokens_total", backend="dp") == reported
    finally:
        stop_gateway(gateway)

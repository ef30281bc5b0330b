"""The LMDeploy backend's event stream against LMDeploy's real api_server (stub engine echoing the user turn)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    UnavailableError,
    UpstreamError,
)
from backends.interface import Delta, Event, Finish, GenerateRequest, SamplingOptions, ToolCallDelta, Usage

from ...conftest import wait_until
from .conftest import PUBLIC_MODEL, SESSION_LEN, running_backend
from .harness.server import HarnessNode

_ids = itertools.count()


def chat(content: str, **kwargs: Any) -> GenerateRequest:
    sampling = kwargs.pop("sampling", SamplingOptions())
    return GenerateRequest(
        request_id=f"t{next(_ids)}",
        model=PUBLIC_MODEL,
        messages=[{"role": "user", "content": content}],
        sampling=sampling,
        **kwargs,
    )


async def collect(backend: Any, request: GenerateRequest) -> list[Event]:
    return [event async for event in backend.generate(request)]


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_chat_streams_text_deltas_then_finish_then_exact_usage(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        events = await collect(backend, chat("Hello world! The quick brown fox"))
    assert text_of(events) == "Hello world! The quick brown fox"
    deltas = [e for e in events if isinstance(e, Delta)]
    # one delta per network read of the node's stream (test_stream_bursts.py), never an empty one
    assert deltas and all(d.text for d in deltas)
    assert isinstance(events[-2], Finish) and events[-2].reason == "stop" and events[-2].matched_stop is None
    usage = events[-1]
    assert isinstance(usage, Usage)
    assert usage.completion_tokens == 8  # the tokens of the echo; the EOS is not counted (as LMDeploy counts)
    assert usage.prompt_tokens > usage.completion_tokens


async def test_every_upstream_request_carries_an_explicit_max_tokens(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        await collect(backend, chat("Hi [[stub tag=bound-default]]"))
        await collect(backend, chat("Hi [[stub tag=bound-7]]", sampling=SamplingOptions(max_tokens=7)))
    (default,) = node.events(event="start", tag="bound-default")
    (asked,) = node.events(event="start", tag="bound-7")
    assert default["max_new_tokens"] == SESSION_LEN, "without a client bound the node's session length is sent"
    assert asked["max_new_tokens"] == 7


async def test_max_tokens_reached_finishes_with_length(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        events = await collect(backend, chat("one two three four five six", sampling=SamplingOptions(max_tokens=3)))
    assert [e.reason for e in events if isinstance(e, Finish)] == ["length"]
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens == 3


async def test_stop_string_longer_than_one_token_is_enforced_and_the_upstream_request_cancelled(
    node: HarnessNode,
) -> None:
    # "lazy dog" is four tokens of the stub's vocabulary: LMDeploy itself would ignore it.
    content = "The quick brown fox jumps over the lazy dog and runs [[stub delay=0.05 tag=stop-multi]]"
    request = chat(content, sampling=SamplingOptions(stop=["lazy dog"]))
    async with running_backend([node.url]) as backend:
        events = await collect(backend, request)
    assert text_of(events) == "The quick brown fox jumps over the "
    assert [(e.reason, e.matched_stop) for e in events if isinstance(e, Finish)] == [("stop", "lazy dog")]
    usage = events[-1]
    assert isinstance(usage, Usage), "usage stays available when the gateway ends the stream"
    assert usage.prompt_tokens == node.events(event="start", tag="stop-multi")[0]["prompt_tokens"]
    assert 9 <= usage.completion_tokens < 14
    assert wait_until(lambda: node.events(event="cancel", tag="stop-multi"))
    assert not node.events(event="finish", tag="stop-multi"), "the engine request was cut, not run to its end"


async def test_stop_string_split_across_chunks_is_held_back_and_never_emitted(node: HarnessNode) -> None:
    request = chat("alpha beta gamma STOP delta [[stub chunk=1]]", sampling=SamplingOptions(stop=[" gamma STOP"]))
    async with running_backend([node.url]) as backend:
        events = await collect(backend, request)
    assert text_of(events) == "alpha beta"
    assert "gamma" not in "".join(e.text for e in events if isinstance(e, Delta))


async def test_reasoning_enabled_through_chat_template_kwargs_comes_out_as_reasoning_deltas(node: HarnessNode) -> None:
    request = chat("Let me think</think>The answer is forty two", chat_template_kwargs={"enable_thinking": True})
    async with running_backend([node.url]) as backend:
        events = await collect(backend, request)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.reasoning for d in deltas) == "Let me think"
    assert "".join(d.text for d in deltas) == "The answer is forty two"
    # Chunks read together go on as one delta (coalesce), so one delta may end the reasoning and start the answer;
    # what a client relies on is the order: no reasoning after the first content.
    first_content = next(i for i, d in enumerate(deltas) if d.text)
    assert not any(d.reasoning for d in deltas[first_content + 1 :])
    usage = events[-1]
    assert isinstance(usage, Usage) and usage.reasoning_tokens and usage.reasoning_tokens >= 3


async def test_thinking_flag_is_sent_as_template_kwargs(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        thinking = await collect(backend, chat("Hmm</think>Yes", thinking=True))
        plain = await collect(backend, chat("Hmm</think>Yes", thinking=False))
    assert "".join(e.reasoning for e in thinking if isinstance(e, Delta)) == "Hmm"
    assert text_of(plain) == "Hmm</think>Yes"


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


async def test_tool_calls_come_out_as_tool_call_deltas_with_finish_reason_tool_calls(node: HarnessNode) -> None:
    content = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with running_backend([node.url]) as backend:
        events = await collect(backend, chat(content, tools=[WEATHER_TOOL]))
    calls = [c for e in events if isinstance(e, Delta) and e.tool_calls for c in e.tool_calls]
    assert all(isinstance(c, ToolCallDelta) and c.index == 0 for c in calls)
    assert calls[0].id and calls[0].id.startswith("chatcmpl-tool-") and calls[0].name == "get_weather"
    assert all(c.id is None and c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert text_of(events) == "Sure."
    assert [e.reason for e in events if isinstance(e, Finish)] == ["tool_calls"]


async def test_logprobs_put_the_chosen_token_back_into_top_logprobs_as_text(node: HarnessNode) -> None:
    request = chat("Hello world", sampling=SamplingOptions(logprobs=True, top_logprobs=2))
    async with running_backend([node.url]) as backend:
        events = await collect(backend, request)
    entries = [lp for e in events if isinstance(e, Delta) and e.logprobs for lp in e.logprobs]
    assert [lp.token for lp in entries] == ["Hello", " world"], "byte-level spellings (Ġworld) become text"
    assert entries[1].bytes == list(b" world")
    for lp in entries:
        assert len(lp.top) == 2
        assert lp.top[0].token == lp.token and lp.top[0].logprob == lp.logprob
        assert lp.top[1].logprob < lp.logprob


async def test_min_tokens_and_ignore_eos_are_translated(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        at_least = await collect(backend, chat("one two", sampling=SamplingOptions(min_tokens=5, max_tokens=20)))
        cycling = await collect(backend, chat("one two", sampling=SamplingOptions(ignore_eos=True, max_tokens=6)))
    assert at_least[-1].completion_tokens >= 5 and text_of(at_least).startswith("one twoone")
    assert cycling[-1].completion_tokens == 6
    assert [e.reason for e in cycling if isinstance(e, Finish)] == ["length"]


async def test_text_and_token_id_prompts_go_through_generate_with_exact_usage(node: HarnessNode) -> None:
    text = GenerateRequest(request_id="g1", model=PUBLIC_MODEL, prompt="The quick brown fox", echo=True)
    async with running_backend([node.url]) as backend:
        events = await collect(backend, text)
        ids = await collect(
            backend, GenerateRequest(request_id="g2", model=PUBLIC_MODEL, prompt_token_ids=[315, 441], n=2)
        )
    assert events[0].text == "The quick brown fox"  # the echoed prompt
    assert text_of(events[1:]) == "The quick brown fox"
    assert events[-1] == Usage(4, 4)
    assert sorted(text_of([e for e in ids if getattr(e, "index", None) == i]) for i in (0, 1)) == ["Hello world"] * 2
    assert ids[-1] == Usage(2, 4), "n choices: the prompt is counted once, completions add up"


async def test_seed_on_completions_is_rejected_naming_the_parameter(node: HarnessNode) -> None:
    request = GenerateRequest(request_id="s", model=PUBLIC_MODEL, prompt="x", sampling=SamplingOptions(seed=1))
    async with running_backend([node.url]) as backend:
        with pytest.raises(InvalidRequestError) as raised:
            await collect(backend, request)
    assert raised.value.param == "seed"


async def test_n_choices_get_one_upstream_request_each_with_consecutive_seeds(node: HarnessNode) -> None:
    request = chat("Hello there [[stub tag=fanout]]", n=3, sampling=SamplingOptions(seed=40))
    async with running_backend([node.url]) as backend:
        events = await collect(backend, request)
    assert len(node.events(event="start", tag="fanout")) == 3
    for index in range(3):
        assert text_of([e for e in events if getattr(e, "index", None) == index]) == "Hello there"
    usage = events[-1]
    assert isinstance(usage, Usage) and usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("request_", "error", "param"),
    [
        (chat("Hi", sampling=SamplingOptions(temperature=3.0)), InvalidRequestError, "temperature"),
        (chat("Hi", sampling=SamplingOptions(top_p=0.0)), InvalidRequestError, "top_p"),
        (chat("hello " * 300), ContextLengthExceededError, "messages"),
        (chat("Hi", response_format={"type": "regex_schema", "regex_schema": "(unclosed"}), InvalidRequestError, None),
        (chat("Hi [[stub fail=INTERNAL_ENGINE_ERROR after=0]]"), UpstreamError, None),
        (chat("Hi [[stub fail=INPUT_LENGTH_ERROR after=0]]"), ContextLengthExceededError, "messages"),
        (chat("Hi [[stub fail=NO_QUEUE after=0]]"), UnavailableError, None),
        (chat("Hi [[stub fail=CANCEL after=0]]"), UnavailableError, None),
    ],
    ids=[
        "bad-temperature",
        "bad-top-p",
        "context-length",
        "bad-regex",
        "engine-failure-before-first-token",
        "engine-input-length",
        "engine-unavailable",
        "engine-abort",
    ],
)
async def test_lmdeploy_errors_before_the_first_token_become_typed_errors(
    node: HarnessNode, request_: GenerateRequest, error: type[BackendError], param: str | None
) -> None:
    async with running_backend([node.url]) as backend:
        with pytest.raises(error) as raised:
            await collect(backend, request_)
    assert type(raised.value) is error
    assert raised.value.param == param


async def test_engine_failure_after_the_first_token_ends_the_stream_with_an_upstream_error(node: HarnessNode) -> None:
    seen: list[Event] = []
    async with running_backend([node.url]) as backend:
        with pytest.raises(UpstreamError):
            async for event in backend.generate(chat("Hello world again [[stub fail=INTERNAL_ENGINE_ERROR after=2]]")):
                seen.append(event)
    assert text_of(seen) == "Hello world"


async def test_unknown_upstream_model_is_model_not_found(node: HarnessNode) -> None:
    async with running_backend([node.url], model_map={PUBLIC_MODEL: "no-such-model"}) as backend:
        with pytest.raises(ModelNotFoundError):
            await collect(backend, chat("Hi"))


async def test_wrong_api_key_is_an_upstream_error_not_a_client_auth_error(node: HarnessNode) -> None:
    async with running_backend([node.url], api_key="sk-wrong", model=PUBLIC_MODEL) as backend:
        with pytest.raises(UpstreamError) as raised:
            await collect(backend, chat("Hi"))
    assert raised.value.code == "upstream_auth"


async def test_model_name_is_discovered_from_the_node(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        assert backend.readiness()[0]
        assert backend.pool.nodes[0].model == "stub-model"


async def test_unreachable_node_makes_the_backend_not_ready_with_a_reason() -> None:
    async with running_backend(["http://127.0.0.1:9"]) as backend:
        ready, reason = backend.readiness()
        assert not ready and "127.0.0.1:9" in reason and "unreachable" in reason
        with pytest.raises(UnavailableError):
            await collect(backend, chat("Hi"))

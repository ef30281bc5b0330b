"""The Responses API through a real server, with the openai SDK and raw HTTP, checked against the SDK's types."""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from backends.config import ReferenceBackendConfig
from backends.interface import Backend, Event, GenerateRequest, Usage
from backends.registry import build_backend
from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway, wait_until
from ..responses_conformance import ConformingTransport, check_event, check_item_list, check_response, sse_events

QUESTION = "Tell me about the module."
CITIES = ["Paris", "Rome", "Oslo"]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": CITIES}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Forecast(BaseModel):
    """Bounded, so that the reference model's meaningless text always completes it."""

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Unit
    summary: str = Field(max_length=24)


@pytest.fixture(scope="module")
def http(responses_gateway: RunningGateway) -> httpx.Client:
    with httpx.Client(base_url=responses_gateway.base_url, timeout=60) as client:
        yield client  # type: ignore[misc]


def stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events, each validated, with the framing checks every stream must pass."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    for event in events:
        check_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    return events


def test_string_input_gives_a_conforming_response_with_text_and_usage(
    responses_client: openai.OpenAI, http: httpx.Client, conforming_transport: ConformingTransport
) -> None:
    checked = conforming_transport.counts["bodies"]
    response = responses_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=400)
    assert conforming_transport.counts["bodies"] == checked + 1
    assert response.id.startswith("resp_")
    assert response.status == "completed" and response.model == MODEL
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= 400
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    raw = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 16})
    assert raw.status_code == 200
    check_response(raw.json())


def test_instructions_and_item_input_reach_the_prompt(responses_client: openai.OpenAI) -> None:
    bare = responses_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
    instructed = responses_client.responses.create(
        model=MODEL, input=QUESTION, instructions="Answer in one short sentence.", max_output_tokens=4
    )
    assert instructed.instructions == "Answer in one short sentence."
    assert instructed.usage.input_tokens > bare.usage.input_tokens  # type: ignore[union-attr]
    items = responses_client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=4,
    )
    assert items.usage.input_tokens == bare.usage.input_tokens  # type: ignore[union-attr]


def test_max_output_tokens_cut_is_an_incomplete_response(responses_client: openai.OpenAI, http: httpx.Client) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "ignore_eos": True}
    response = check_response(http.post("/v1/responses", json=body).json())
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    events = stream(http, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_follows_openais_event_sequence_and_rebuilds_the_whole_response(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 400, "seed": 3, "temperature": 1.0}
    events = stream(http, body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2] if "item_id" in e)
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")
    final = events[-1]["response"]
    assert done["text"] == streamed == final["output"][0]["content"][0]["text"]
    assert final["output"][0]["id"] == item_id and final["status"] == "completed"
    assert final["usage"]["output_tokens"] > 0
    whole = http.post("/v1/responses", json=body).json()
    assert whole["output"][0]["content"][0]["text"] == streamed


def test_sdk_stream_yields_text_events_and_a_final_response(
    responses_client: openai.OpenAI, conforming_transport: ConformingTransport
) -> None:
    checked = conforming_transport.counts["events"]
    with responses_client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=400) as events:
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert deltas and "".join(deltas) == final.output_text
    assert final.status == "completed"
    assert conforming_transport.counts["events"] == checked + len(deltas) + 8, "every event the SDK saw was checked"


def test_parse_fills_a_bounded_pydantic_model(responses_client: openai.OpenAI, http: httpx.Client) -> None:
    parsed = responses_client.responses.parse(
        model=MODEL, input="The forecast, please.", text_format=Forecast, max_output_tokens=200
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.text is not None and parsed.text.format is not None and parsed.text.format.type == "json_schema"
    with responses_client.responses.stream(
        model=MODEL, input="The forecast, please.", text_format=Forecast, max_output_tokens=200
    ) as events:
        final = events.get_final_response()
    assert isinstance(final.output_parsed, Forecast)


def test_json_object_format_constrains_the_text_to_json(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Some JSON.", "text": {"format": {"type": "json_object"}}, "max_output_tokens": 8}
    response = check_response(http.post("/v1/responses", json=body).json())
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_object"
    assert response.output_text.lstrip().startswith("{")


def test_previous_response_id_continues_the_conversation(responses_client: openai.OpenAI) -> None:
    first = responses_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12)
    second = responses_client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=12
    )
    assert second.previous_response_id == first.id
    alone = responses_client.responses.create(model=MODEL, input="And then?", max_output_tokens=12)
    # The first exchange is in the prompt of the second: its question, and the answer it got ...
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens  # type: ignore[union-attr]
    replayed = responses_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "And then?"},
        ],
        max_output_tokens=12,
    )
    assert replayed.usage.input_tokens == second.usage.input_tokens  # type: ignore[union-attr]  # ... exactly so
    third = responses_client.responses.create(
        model=MODEL, input="Finally?", previous_response_id=second.id, max_output_tokens=4
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens  # type: ignore[union-attr]


def test_unknown_previous_response_is_a_400_naming_it(responses_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert caught.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_store_false_keeps_nothing(responses_client: openai.OpenAI) -> None:
    response = responses_client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        responses_client.responses.create(model=MODEL, input="hi", previous_response_id=response.id)


def test_get_input_items_and_delete_a_stored_response(responses_client: openai.OpenAI, http: httpx.Client) -> None:
    created = responses_client.responses.create(
        model=MODEL,
        input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_output_tokens=8,
    )
    raw = http.get(f"/v1/responses/{created.id}")
    assert raw.status_code == 200
    assert check_response(raw.json()) == created
    listed = check_item_list(http.get(f"/v1/responses/{created.id}/input_items", params={"order": "asc"}).json())
    assert [(i.type, i.role) for i in listed.data] == [("message", "developer"), ("message", "user")]  # type: ignore[union-attr]
    newest_first = responses_client.responses.input_items.list(created.id, limit=1)
    assert [i.id for i in newest_first.data] == [listed.data[1].id] and newest_first.has_more
    rest = responses_client.responses.input_items.list(created.id, after=listed.data[1].id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more
    deleted = http.delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.delete(created.id)
    missing = http.get("/v1/responses/resp_nothing/input_items")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_a_streamed_response_is_stored_and_chainable_at_once(responses_client: openai.OpenAI) -> None:
    with responses_client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=400) as events:
        final = events.get_final_response()
    assert responses_client.responses.retrieve(final.id).output_text == final.output_text
    follow = responses_client.responses.create(
        model=MODEL, input="More.", previous_response_id=final.id, max_output_tokens=4
    )
    assert follow.previous_response_id == final.id


def test_forced_function_call_then_its_output_gives_an_answer(responses_client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = responses_client.responses.create(
        model=MODEL, input=question, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=200
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) >= 1 and called.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id
    assert json.loads(call.arguments)["city"] in CITIES
    answered = responses_client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}],
        previous_response_id=called.id,
        tools=[WEATHER_TOOL],
        max_output_tokens=200,
    )
    assert answered.status in ("completed", "incomplete") and answered.output
    named = responses_client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    )
    assert [item.type for item in named.output] == ["function_call"]


def test_streamed_function_call_events_add_up_to_the_call(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": "What is the weather in Rome?",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_output_tokens": 200,
    }
    events = stream(http, body)
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    final = events[-1]
    assert final["type"] == "response.completed"
    assert pieces == done["arguments"] == final["response"]["output"][0]["arguments"]
    assert json.loads(pieces)["city"] in CITIES


def test_reasoning_effort_returns_the_thinking_as_a_reasoning_item(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": QUESTION, "reasoning": {"effort": "high"}, "max_output_tokens": 400}
    response = check_response(http.post("/v1/responses", json=body).json())
    assert response.output[0].type == "reasoning"
    thinking = response.output[0].content
    assert thinking and thinking[0].text
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0
    events = stream(http, body)
    assert events[2]["item"]["type"] == "reasoning"
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == next(e["text"] for e in events if e["type"] == "response.reasoning_text.done")
    # the reasoning item replayed as input reaches the prompt as the turn's reasoning
    replay = {"model": MODEL, "input": [{"role": "user", "content": QUESTION}, *events[-1]["response"]["output"]]}
    assert http.post("/v1/responses", json={**replay, "max_output_tokens": 4}).status_code == 200


def test_logprobs_when_included(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": QUESTION,
        "max_output_tokens": 5,
        "ignore_eos": True,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "seed": 2,  # this seed samples an end-of-sentence among the 5 tokens (ignored under ignore_eos)
    }
    response = check_response(http.post("/v1/responses", json=body).json())
    content = response.output[0].content[0]
    logprobs = content.logprobs  # type: ignore[union-attr]
    # output_text logprobs cover the text: one entry per token of it; a special token that adds no text has none
    assert logprobs is not None and 1 <= len(logprobs) <= 5
    assert b"".join(bytes(e.bytes) for e in logprobs).decode("utf-8", "replace") == content.text  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",  # an image URL: not fetched (data URLs only)
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
        ({"input": []}, "input"),
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]}, "input[0]"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),  # named by the backend
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
            "text.format",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_model_is_a_404_and_unknown_response_too(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    missing = http.get("/v1/responses/resp_nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_requests_are_counted_by_model_and_backend(responses_client: openai.OpenAI, http: httpx.Client) -> None:
    def served() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("gateway_requests_total{") and f'model="{MODEL}"' in line and 'status="200"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = served()
    responses_client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert served() == before + 1


def test_disconnect_mid_stream_aborts_the_engine_request() -> None:
    slow = GatewayConfig(  # 30 s of decoding: the stream cannot end by itself while the test looks
        server={"stores": {"responses_store": "memory"}},
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(slow)
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(base_url=running.base_url, timeout=30) as client,
            client.stream("POST", "/v1/responses", json=body) as response,
        ):
            lines = response.iter_lines()  # kept: dropping the iterator would close the connection at once
            assert next(line for line in lines if line.startswith("data: "))
            assert running.driver_in_flight() == 1
        assert wait_until(lambda: running.engine_unfinished() == 0 and running.driver_in_flight() == 0)
    finally:
        stop_gateway(running)


def test_a_stream_past_its_deadline_ends_with_response_failed_and_is_not_stored() -> None:
    config = GatewayConfig(
        server={"streams": {"request_timeout": 1.0}, "stores": {"responses_store": "memory"}},
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": 0.01}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=running.base_url, timeout=30) as client:
            with (
                captured_logs(running) as logs,
                client.stream("POST", "/v1/responses", json=body) as response,
            ):
                assert response.status_code == 200
                events = sse_events(list(response.iter_lines()))
            for event in events:
                check_event(event)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            failed = events[-1]
            assert failed["type"] == "response.failed", "the stream ends with response.failed, not [DONE]"
            assert failed["response"]["status"] == "failed"
            assert failed["response"]["error"]["code"] == "server_error"
            request_id = response.headers["x-request-id"]
            assert failed["response"]["error"]["message"] == f"The request timed out. (request id {request_id})"
            (line,) = [line for line in logs if line.get("event") == "request" and line["request_id"] == request_id]
            assert "deadline" in line["error_detail"], "the log says which deadline"
            streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert streamed, "tokens flowed before the deadline"
            unfinished = failed["response"]["output"][0]
            assert unfinished["id"] == events[2]["item"]["id"] and unfinished["status"] == "incomplete"
            assert unfinished["content"][0]["text"] == streamed
            assert client.get(f"/v1/responses/{failed['response']['id']}").status_code == 404
        assert wait_until(lambda: running.engine_unfinished() == 0)
    finally:
        stop_gateway(running)


def test_thinking_then_a_forced_call_then_its_output(responses_client: openai.OpenAI) -> None:
    with responses_client.responses.stream(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        reasoning={"effort": "high"},
        max_output_tokens=400,
    ) as events:
        called = events.get_final_response()
    assert [item.type for item in called.output][:2] == ["reasoning", "function_call"]
    call = called.output[1]
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in CITIES
    answered = responses_client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "snow"}],
        tools=[WEATHER_TOOL],
        reasoning={"effort": "high"},
        max_output_tokens=400,
    )
    assert answered.output[0].type == "reasoning" and answered.usage is not None
    assert answered.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens  # type: ignore[union-attr]


class UsagelessBackend:
    """Test double: the real reference backend behind an upstream that reports no usage, as an OpenAI-compatible
    node that ignores ``stream_options.include_usage`` does (or LMDeploy's stream cut by the gateway at a stop
    string, whose prompt tokens it cannot count with tools): every event passes but ``Usage``."""

    def __init__(self, inner: Backend) -> None:
        self._inner = inner
        self.name = inner.name
        self.kind = inner.kind

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await self._inner.stop()

    def readiness(self) -> tuple[bool, str]:
        return self._inner.readiness()

    def max_model_len(self) -> int | None:
        return self._inner.max_model_len()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        async with aclosing(self._inner.generate(request)) as events:
            async for event in events:
                if not isinstance(event, Usage):
                    yield event


def test_a_response_without_usage_still_ends_with_its_terminal_event_and_is_stored() -> None:
    inner = build_backend(ReferenceBackendConfig(name="reference"))
    config = GatewayConfig(
        server={"stores": {"responses_store": "memory"}},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config, backends={"reference": UsagelessBackend(inner)})
    client = openai.OpenAI(
        base_url=f"{running.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(transport=ConformingTransport()),
    )
    try:
        forced = {"type": "function", "name": "get_weather"}
        for tools in ({}, {"tools": [WEATHER_TOOL], "tool_choice": forced}):
            with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=400, **tools) as events:  # type: ignore[arg-type]
                kinds = [event.type for event in events]
                final = events.get_final_response()  # raises unless the stream ended with response.completed
            assert kinds[-1] == "response.completed" and final.status == "completed"
            assert final.usage is None, "no usage reported, none made up"
            stored = client.responses.retrieve(final.id)
            assert stored.status == final.status and stored.output_text == final.output_text
            assert [item.type for item in stored.output][-1] == ("function_call" if tools else "message")
        with httpx.stream(
            "POST",
            f"{running.base_url}/v1/responses",
            json={"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "ignore_eos": True, "stream": True},
        ) as response:
            last = sse_events(list(response.iter_lines()))[-1]
        assert last["type"] == "response.incomplete" and last["response"]["usage"] is None
        assert client.responses.retrieve(last["response"]["id"]).status == "incomplete"
        whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8)
        assert whole.usage is None and client.responses.retrieve(whole.id).id == whole.id
    finally:
        stop_gateway(running)

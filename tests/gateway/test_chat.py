"""Chat completions through a real server with the official OpenAI SDK, checked against OpenAI's schemas."""

from __future__ import annotations

import httpx
import openai
import orjson

from ..conformance import OpenAISchemas
from ..conftest import MODEL, RunningGateway, wait_until

HELLO = [{"role": "user", "content": "Tell me about the module."}]


def sse_payloads(response: httpx.Response) -> list[bytes]:
    """The data of every SSE frame, in order."""
    return [line[6:].encode() for line in response.iter_lines() if line.startswith("data: ")]


def test_chat_completion_returns_text_usage_and_conforms(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12)
    choice = completion.choices[0]
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    raw = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 12})
    schemas.check("CreateChatCompletionResponse", raw.json())


def test_max_tokens_reached_gives_finish_reason_length(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_stream_chunks_conform_and_rebuild_the_whole_text(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 20,
        "seed": 11,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    assert len({c["id"] for c in chunks}) == 1
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant"
    assert first["delta"]["content"], "the first frame waits for the first token and carries it"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    whole = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert streamed == whole["choices"][0]["message"]["content"]


def test_sdk_streaming_yields_the_same_text_as_non_streaming(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": HELLO, "max_tokens": 16, "seed": 5}
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**args, stream=True)
        if chunk.choices
    )
    assert streamed == client.chat.completions.create(**args).choices[0].message.content


def test_same_seed_and_parameters_give_the_same_text(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    first = client.chat.completions.create(**args, seed=1234).choices[0].message.content
    second = client.chat.completions.create(**args, seed=1234).choices[0].message.content
    assert first == second
    others = {client.chat.completions.create(**args, seed=s).choices[0].message.content for s in range(1, 6)}
    assert len(others) > 1, "different seeds should not all give the same text"


def test_n_choices_are_distinct_and_indexed(client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, n=3, seed=7)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.message.content for c in completion.choices}) > 1
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "n": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [orjson.loads(p) for p in sse_payloads(response)[:-1]]
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_logprobs_have_openai_shape_and_top_alternatives(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == completion.choices[0].message.content
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [orjson.loads(p) for p in sse_payloads(response)[:-1]]
    for chunk in chunks:
        schemas.check("CreateChatCompletionStreamResponse", chunk)
    assert any(c["choices"][0]["logprobs"] for c in chunks)


def test_greedy_top_logprob_is_the_chosen_token(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    for entry in completion.choices[0].logprobs.content:
        assert entry.top_logprobs[0].token == entry.token


def _greedy_tokens(client: openai.OpenAI, max_tokens: int = 40) -> tuple[str, list[str]]:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    return completion.choices[0].message.content, [t.token for t in completion.choices[0].logprobs.content]


def test_stop_string_split_across_tokens_is_cut_and_never_emitted(client: openai.OpenAI) -> None:
    text, tokens = _greedy_tokens(client)
    # a stop string that starts inside one token and ends inside the next
    k = next(
        i
        for i in range(3, len(tokens) - 1)
        if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2 and tokens[i].isprintable() and tokens[i + 1].isprintable()
    )
    stop = tokens[k][-2:] + tokens[k + 1][:2]
    expected = text[: text.find(stop)]
    args = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 40,
        "temperature": 0,
        "stop": [stop],
        "extra_body": {"ignore_eos": True},
    }
    completion = client.chat.completions.create(**args)
    assert completion.choices[0].message.content == expected
    assert completion.choices[0].finish_reason == "stop"
    streamed = [
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices
    ]
    assert "".join(streamed) == expected
    assert stop not in "".join(streamed)


def test_stop_string_match_aborts_the_engine_request(timed_gateway: RunningGateway) -> None:
    timed = openai.OpenAI(base_url=f"{timed_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    _, tokens = _greedy_tokens(timed, 30)
    stop = tokens[2]
    for stream in (False, True):
        before = timed_gateway.engine_tokens()
        answer = timed.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=4000,
            temperature=0,
            stop=stop,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            for _ in answer:  # type: ignore[union-attr]
                pass
        assert wait_until(timed_gateway.engine_idle)
        # the stop string is in the third token: without an abort the engine would generate all 4,000
        assert timed_gateway.engine_tokens() - before <= 400


def test_multi_turn_system_developer_and_text_parts_are_accepted(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "text", "text": "question"}]},
        {"role": "assistant", "content": "An answer."},
        {"role": "user", "content": "And then?"},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert completion.usage is not None and completion.usage.prompt_tokens > 15


def test_request_id_is_accepted_returned_and_generated(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    mine = http.post("/v1/chat/completions", json=body, headers={"X-Request-ID": "my-trace-42"})
    assert mine.headers["x-request-id"] == "my-trace-42"
    fresh = http.post("/v1/chat/completions", json=body)
    assert len(fresh.headers["x-request-id"]) >= 16
    assert http.get("/health").headers["x-request-id"]
    with http.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Request-ID": "stream-7"}
    ) as response:
        assert response.headers["x-request-id"] == "stream-7"


def test_response_names_the_backend_that_served_it(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert response.headers["x-backend"] == "reference"

"""Text completions: prompts as text, token ids and lists, echo, logprobs, streaming, schema conformance."""

from __future__ import annotations

import httpx
import openai
import orjson

from ..conformance import OpenAISchemas
from ..conftest import MODEL
from .test_chat import sse_payloads


def test_completion_of_a_text_prompt_conforms(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    completion = client.completions.create(model=MODEL, prompt="The module", max_tokens=10)
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens <= 10
    schemas.check(
        "CreateCompletionResponse",
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}).json(),
    )


def test_default_max_tokens_is_sixteen_as_openai(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The", extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 16


def test_list_of_prompts_gives_n_choices_per_prompt_in_order(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=["One", "Two", "Three"], max_tokens=4, n=2)
    assert [c.index for c in completion.choices] == list(range(6))
    assert completion.usage is not None and completion.usage.completion_tokens <= 24


def test_token_id_prompts_are_accepted_singly_and_as_lists(client: openai.OpenAI) -> None:
    single = client.completions.create(model=MODEL, prompt=[0, 300, 301, 302], max_tokens=3)
    assert single.usage is not None and single.usage.prompt_tokens == 4
    batch = client.completions.create(model=MODEL, prompt=[[0, 300], [0, 400, 401]], max_tokens=3)
    assert len(batch.choices) == 2
    assert batch.usage is not None and batch.usage.prompt_tokens == 5


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Echo me:", max_tokens=4, echo=True)
    assert completion.choices[0].text.startswith("Echo me:")


def test_logprobs_use_the_completions_format(client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="The", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": "The", "max_tokens": 3, "logprobs": 1})
    schemas.check("CreateCompletionResponse", raw.json())


def test_stream_chunks_conform_and_end_with_usage_and_done(http: httpx.Client, schemas: OpenAISchemas) -> None:
    body = {
        "model": MODEL,
        "prompt": ["A", "B"],
        "max_tokens": 6,
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        payloads = sse_payloads(response)
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    for chunk in chunks:
        schemas.check_completion_chunk(chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    finished = {c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_completion_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model=MODEL, prompt="The", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[5:8]
    cut = client.completions.create(
        model=MODEL, prompt="The", max_tokens=30, temperature=0, stop=stop, extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"

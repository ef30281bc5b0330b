"""Client mistakes get the right 4xx with OpenAI's error body, never a 500 (and never FastAPI's 422)."""

from __future__ import annotations

import httpx
import openai
import pytest

from ..conformance import OpenAISchemas
from ..conftest import MODEL, TINY_CONTEXT, TINY_MODEL

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


BAD_CHAT = [
    pytest.param(chat(max_tokens=-1), "max_tokens", id="negative-max-tokens"),
    pytest.param(chat(max_tokens=0), "max_tokens", id="zero-max-tokens"),
    pytest.param(chat(max_tokens=2**40), "max_tokens", id="huge-max-tokens"),
    pytest.param(chat(max_tokens="ten"), "max_tokens", id="wrong-type"),
    pytest.param(chat(n=1000), "n", id="n-too-large"),
    pytest.param(chat(n=17), "n", id="n-over-configured-limit"),
    pytest.param(chat(top_p=-0.1), "top_p", id="negative-top-p"),
    pytest.param(chat(temperature=-0.5), "temperature", id="negative-temperature"),
    pytest.param(chat(messages=[]), "messages", id="empty-messages"),
    pytest.param(chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", id="unknown-role"),
    pytest.param(chat(messages=[{"role": "user"}]), "messages[0].content", id="user-without-content"),
    pytest.param(chat(messages="hello"), "messages", id="messages-not-a-list"),
    pytest.param({"messages": USER}, "model", id="missing-model"),
    pytest.param(chat(presence_penalty=0.5), "presence_penalty", id="penalty"),
    pytest.param(chat(frequency_penalty=1), "frequency_penalty", id="frequency-penalty"),
    pytest.param(chat(logit_bias={"5": 10}), "logit_bias", id="logit-bias"),
    pytest.param(
        chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name", id="tools"
    ),
    pytest.param(chat(response_format={"type": "xml"}), "response_format.type", id="unknown-response-format"),
    pytest.param(chat(reasoning_effort="extreme"), "reasoning_effort", id="reasoning"),
    pytest.param(chat(audio={"voice": "alloy", "format": "wav"}), "audio", id="audio"),
    pytest.param(chat(modalities=["text", "audio"]), "modalities", id="modalities"),
    pytest.param(chat(top_logprobs=3), "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param(chat(logprobs=True, top_logprobs=21), "top_logprobs", id="top-logprobs-over-20"),
    pytest.param(
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content[0]",
        id="image-url-not-fetched",
    ),
    pytest.param(chat(stop=[""]), "stop[0]", id="empty-stop"),
    pytest.param(chat(bogus_field=1), "bogus_field", id="unknown-field"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_bad_chat_request_is_a_400_naming_the_parameter(
    http: httpx.Client, schemas: OpenAISchemas, body: dict[str, object], param: str
) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    schemas.check("ErrorResponse", error)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    assert error["error"]["message"]


def test_defaults_of_unsupported_fields_are_accepted(http: httpx.Client) -> None:
    body = chat(
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        response_format={"type": "text"},
        tool_choice="none",
        modalities=["text"],
        reasoning_effort="none",
        user="u1",
        store=False,
    )
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_malformed_json_is_a_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_model_is_a_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_prompt_over_the_context_length_is_a_400_context_length_exceeded(client: openai.OpenAI) -> None:
    long_text = "word " * (TINY_CONTEXT * 2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": long_text}])
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY_MODEL, prompt="short", max_tokens=TINY_CONTEXT)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": long_text}], stream=True)
    assert caught.value.code == "context_length_exceeded"


def test_without_max_tokens_the_output_fills_the_rest_of_the_context(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=TINY_MODEL, messages=USER, extra_body={"ignore_eos": True})
    assert completion.usage is not None
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == TINY_CONTEXT


BAD_COMPLETIONS = [
    pytest.param({"prompt": "x", "suffix": "y"}, "suffix", id="suffix"),
    pytest.param({"prompt": "x", "best_of": 3}, "best_of", id="best-of-over-n"),
    pytest.param({"prompt": "x", "logprobs": 6}, "logprobs", id="logprobs-over-5"),
    pytest.param({"prompt": []}, "prompt", id="empty-prompt-list"),
    pytest.param({"prompt": [[-1, 5]]}, None, id="negative-token-id"),
    pytest.param({"prompt": [10**7]}, "prompt", id="token-id-outside-vocab"),
    pytest.param({"prompt": "x", "max_tokens": -3}, "max_tokens", id="negative-max-tokens"),
    pytest.param({}, "prompt", id="missing-prompt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_bad_completion_request_is_a_400(
    http: httpx.Client, schemas: OpenAISchemas, fields: dict[str, object], param: str | None
) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, **fields})
    assert response.status_code == 400, response.text
    schemas.check("ErrorResponse", response.json())
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_oversized_body_is_a_413(http: httpx.Client, gateway) -> None:  # type: ignore[no-untyped-def]
    limit = gateway.state.config.server.http.max_body_bytes
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (limit + 10)}]}
    response = http.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}]}'

    response = http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_unknown_route_is_a_404_with_an_error_body(http: httpx.Client) -> None:
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["message"]

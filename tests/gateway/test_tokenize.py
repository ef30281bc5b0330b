"""``/tokenize``, ``/detokenize``, ``/tokenizer_info``: the ids the model sees, with vLLM's field names."""

from __future__ import annotations

import httpx
import openai

from ..conftest import MODEL, TINY_CONTEXT, TINY_MODEL


def tokenize(http: httpx.Client, **body: object) -> dict[str, object]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_text_tokens_are_the_prompt_the_completions_api_sends(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The module defines a class"
    result = tokenize(http, model=MODEL, prompt=prompt)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert completion.usage is not None
    assert result["count"] == len(result["tokens"]) == completion.usage.prompt_tokens  # type: ignore[arg-type]
    assert result["max_model_len"] == 4096
    tokens = result["tokens"]
    assert isinstance(tokens, list) and tokens[0] == 0  # BOS, as for generation
    assert tokenize(http, model=MODEL, prompt=prompt, add_special_tokens=False)["tokens"] == tokens[1:]
    # Scoring the ids gives one logprob entry per id: lm-eval counts context lengths this way.
    scored = client.completions.create(model=MODEL, prompt=tokens, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs is not None and len(scored.choices[0].logprobs.tokens) == len(tokens)


def test_chat_tokens_are_the_prompt_the_chat_api_sends(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does the module define?"},
    ]
    result = tokenize(http, model=MODEL, messages=messages)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and result["count"] == chat.usage.prompt_tokens
    thinking = tokenize(http, model=MODEL, messages=messages, chat_template_kwargs={"thinking": True})
    assert thinking["tokens"] != result["tokens"]  # the encoder's options change the prompt, as in chat
    text = http.post("/detokenize", json={"model": MODEL, "tokens": result["tokens"]}).json()["prompt"]
    assert "<｜User｜>What does the module define?<｜Assistant｜>" in text


def test_chat_tokens_with_a_reasoning_effort_are_the_prompt_of_that_chat_request(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    messages = [{"role": "user", "content": "What does the module define?"}]
    for effort, number in (("low", 50), ("high", 75), (30, 30)):
        result = tokenize(http, model=MODEL, messages=messages, reasoning_effort=effort)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"reasoning_effort": effort},
        )
        assert chat.usage is not None and result["count"] == chat.usage.prompt_tokens
        text = http.post("/detokenize", json={"model": MODEL, "tokens": result["tokens"]}).json()["prompt"]
        assert f"Reasoning Effort: {number} (range 1-100" in text and text.endswith("<｜Assistant｜><think>")
    bad = http.post("/tokenize", json={"messages": messages, "reasoning_effort": "medium-ish"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_detokenize_inverts_tokenize(http: httpx.Client) -> None:
    text = "Return the path — unicode too: ünïcödé, 日本語."
    ids = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    strs = tokenize(http, prompt="Return the", add_special_tokens=False, return_token_strs=True)["token_strs"]
    assert isinstance(strs, list) and "".join(strs).replace("Ġ", " ") == "Return the"


def test_tokenizer_info_names_the_special_tokens_a_remote_tokenizer_needs(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["bos_token"] == "<｜begin▁of▁sentence｜>" and info["eos_token"] == "<｜end▁of▁sentence｜>"
    assert info["model_max_length"] == 4096
    # lm-eval finds the ids by tokenizing the token strings without special tokens added.
    assert tokenize(http, prompt=info["eos_token"], add_special_tokens=False)["tokens"] == [1]
    assert tokenize(http, prompt=info["bos_token"], add_special_tokens=False)["tokens"] == [0]
    tiny = http.get("/tokenizer_info", params={"model": TINY_MODEL}).json()
    assert tiny["max_model_len"] == TINY_CONTEXT


def test_bad_tokenizer_requests_are_openai_errors_naming_the_field(http: httpx.Client) -> None:
    for path, body, status, param in (
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, None),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
        ("/tokenize", {"prompt": "x", "reasoning_effort": "low"}, 400, "reasoning_effort"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ):
        response = http.post(path, json=body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"]
        if param is not None:
            assert error["param"] == param, (body, error)
    assert http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404


def test_tokenizer_requests_are_counted_by_endpoint_and_status(http: httpx.Client) -> None:
    def count(endpoint: str, status: str) -> float:
        line = f'gateway_tokenizer_requests_total{{endpoint="{endpoint}",status="{status}"}} '
        for row in http.get("/metrics").text.splitlines():
            if row.startswith(line):
                return float(row.removeprefix(line))
        return 0.0

    ok, missing = count("tokenize", "200"), count("detokenize", "404")
    tokenize(http, prompt="counted")
    assert http.post("/detokenize", json={"model": "nope", "tokens": [1]}).status_code == 404
    assert count("tokenize", "200") == ok + 1 and count("detokenize", "404") == missing + 1

"""Text completions: prompts as text, token ids and lists, echo, logprobs, streaming, schema conformance."""

from __future__ import annotations

import httpx
import jsonschema
import openai
import orjson
import pytest

from ..conformance import OpenAISchemas
from ..conftest import MODEL, TINY_CONTEXT, TINY_MODEL
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
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)  # logprobs + 1: the chosen token is always there
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


# ---- echo + logprobs: scoring prompts (lm-eval's loglikelihood requests) ------------------------------------------


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    prompt = "The module defines"
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, extra_body={"ignore_eos": True}
    )
    choice, usage = completion.choices[0], completion.usage
    assert usage is not None and choice.logprobs is not None
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt)
    total = usage.prompt_tokens + usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == total
    assert len(logprobs.text_offset) == total
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    assert all(lp is not None and lp <= 0.0 for lp in logprobs.token_logprobs[1:])
    entries = zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    for token, logprob, top in entries:
        assert top[token] == logprob  # the scored token is always among its top logprobs
    # Offsets index the echoed text: the first completion token starts where the prompt ends.
    assert logprobs.text_offset[usage.prompt_tokens] == len(prompt)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # The schema takes the null first entries OpenAI's API sends (tests/conformance.NULL_FIRST), and only those.
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 0}
    raw = http.post("/v1/completions", json=body).json()
    schemas.check("CreateCompletionResponse", raw)
    raw["choices"][0]["logprobs"]["top_logprobs"][1] = None
    with pytest.raises(jsonschema.ValidationError):
        schemas.check("CreateCompletionResponse", raw)


def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(client: openai.OpenAI) -> None:
    prompt = [0, 300, 301, 302, 303, 304]
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice, usage = scored.choices[0], scored.usage
    assert usage is not None and usage.prompt_tokens == len(prompt) and usage.completion_tokens == 0
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert len(choice.logprobs.tokens) == len(prompt)
    # Causal: a prefix scores exactly as the same positions of the longer prompt (each position only sees its past).
    prefix = client.completions.create(model=MODEL, prompt=prompt[:4], max_tokens=0, echo=True, logprobs=0)
    assert prefix.choices[0].logprobs is not None
    assert prefix.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:4]
    plain = client.completions.create(model=MODEL, prompt="Only the prompt", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Only the prompt" and plain.choices[0].logprobs is None


def test_scoring_a_prompt_longer_than_the_context_is_a_context_length_error(http: httpx.Client) -> None:
    prompt = [0] + [300] * TINY_CONTEXT
    for extra in ({"echo": True, "logprobs": 0}, {"echo": True}, {}):
        body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 0, **extra}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["code"] == "context_length_exceeded"


def test_a_long_prompt_is_scored_token_by_token_with_offsets_into_its_text(client: openai.OpenAI) -> None:
    prompt = " ".join(f"Return the value of field {i} — ünïcödé." for i in range(80))
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice, usage = scored.choices[0], scored.usage
    assert usage is not None and usage.prompt_tokens > 512 and choice.logprobs is not None
    assert choice.text == prompt and len(choice.logprobs.tokens) == usage.prompt_tokens
    offsets = choice.logprobs.text_offset
    assert offsets[0] == offsets[1] == 0  # BOS takes no room in the text
    assert offsets == sorted(offsets) and offsets[-1] < len(prompt)
    words = [i for i, token in enumerate(choice.logprobs.tokens) if token == " value"]
    assert words and all(prompt[offsets[i] : offsets[i] + 6] == " value" for i in words)


def test_echo_with_logprobs_scores_every_prompt_of_a_list_for_every_choice(client: openai.OpenAI) -> None:
    """lm-eval batches loglikelihood requests as a list of token-id prompts."""
    prompts = [[0, 300, 301], [0, 400, 401, 402]]
    completion = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=1, echo=True, logprobs=1, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    scored = []
    for choice in completion.choices:
        prompt = prompts[choice.index // 2]
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == len(prompt) + 1
        scored.append(choice.logprobs.token_logprobs[: len(prompt)])
    assert scored[0] == scored[1] and scored[2] == scored[3]  # a prompt scores the same for each of its choices
    assert scored[0] != scored[2]


def test_streamed_echo_with_logprobs_matches_the_whole_response(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Streams of", "max_tokens": 5, "echo": True, "logprobs": 2, "seed": 3}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [orjson.loads(p) for p in sse_payloads(response)[:-1]]
    merged: dict[str, list[object]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key, values in (choice["logprobs"] or {}).items():
                merged[key].extend(values)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    assert merged == whole["logprobs"]


def test_legacy_top_logprobs_always_contain_the_sampled_token(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="The", max_tokens=24, temperature=1.5, seed=11, logprobs=1, extra_body={"ignore_eos": True}
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == 24
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top[token] == logprob
        assert 1 <= len(top) <= 2
    # At this temperature some sampled tokens are not the most likely one; those are the entries that matter.
    assert any(len(top) == 2 for top in logprobs.top_logprobs)


def test_a_reply_ending_on_eos_lists_the_eos_it_counts(
    client: openai.OpenAI, http: httpx.Client, schemas: OpenAISchemas
) -> None:
    for seed in range(64):  # find a seed whose reply ends on EOS; fixed seeds make this deterministic
        completion = client.completions.create(
            model=MODEL, prompt="Return", max_tokens=40, temperature=1.0, seed=seed, logprobs=1
        )
        if completion.choices[0].finish_reason == "stop":
            break
    else:
        raise AssertionError("no seed in 0..63 ended on EOS")
    choice, usage = completion.choices[0], completion.usage
    assert usage is not None and choice.logprobs is not None
    assert len(choice.logprobs.tokens) == usage.completion_tokens
    assert choice.logprobs.tokens[-1] == "<｜end▁of▁sentence｜>"
    assert choice.logprobs.text_offset[-1] == len(choice.text)  # it adds no text
    assert choice.logprobs.token_logprobs[-1] is not None and choice.logprobs.token_logprobs[-1] <= 0.0
    # Streamed, the EOS entry rides on the frame that carries finish_reason.
    body = {"model": MODEL, "prompt": "Return", "max_tokens": 40, "temperature": 1.0, "seed": seed, "logprobs": 1}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [orjson.loads(p) for p in sse_payloads(response)[:-1]]
    for chunk in chunks:
        schemas.check_completion_chunk(chunk)
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["logprobs"]["tokens"] == ["<｜end▁of▁sentence｜>"]
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == choice.logprobs.tokens

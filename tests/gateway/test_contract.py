"""OpenAI's request contract, defect by defect: strict types, nulls and bounds as OpenAI's schema has
them, full parameter paths, no 500 for a client mistake, and every request counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig

from ..conformance import OpenAISchemas
from ..conftest import MODEL, TINY_MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway

USER = [{"role": "user", "content": "hi"}]
UNROUTED = (("backend", ""), ("model", ""))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def post_raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """Sends ``body`` as written: JSON escapes such as ``\\ud800`` reach the server untouched."""
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, param: str | None, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == 400, response.text[:500]
    error = response.json()
    OpenAISchemas.load().check("ErrorResponse", error)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    if code is not None:
        assert error["error"]["code"] == code, error
    return error["error"]


# --- 500s for client mistakes -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [{}, [], None, 3], ids=["object", "array", "null", "number"])
def test_response_format_type_that_is_not_a_string_is_a_400(http: httpx.Client, kind: object) -> None:
    error = assert_400(
        http.post("/v1/chat/completions", json=chat(response_format={"type": kind})), "response_format.type"
    )
    assert "None" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a@b"}]), "messages[0].content"),
        (
            "/v1/chat/completions",
            chat(stream=True, messages=[{"role": "user", "content": "a@b"}]),
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            chat(messages=[*USER, {"role": "user", "content": [{"type": "text", "text": "a@b"}]}]),
            "messages[1].content[0].text",
        ),
        ("/v1/completions", completion(prompt="a@b"), "prompt"),
        ("/v1/completions", completion(prompt=["ok", "a@b"]), "prompt[1]"),
        ("/v1/completions", completion(stream=True, stop=["a@b"]), "stop[0]"),
        ("/v1/chat/completions", chat(model="a@b"), "model"),
    ],
    ids=["chat", "stream", "text-part", "completion", "prompt-list", "stop", "model"],
)
def test_lone_surrogate_is_a_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    raw = json.dumps(body).replace("@", "\\ud800")  # a lone high surrogate, as some clients send it
    error = assert_400(post_raw(http, path, raw), param, "invalid_value")
    assert "surrogate" in error["message"]


def test_a_lone_surrogate_in_an_object_key_is_a_400(http: httpx.Client) -> None:
    raw = json.dumps(chat(metadata={"k@": "v"})).replace("@", "\\udc00")
    assert_400(post_raw(http, "/v1/chat/completions", raw), "metadata")


def test_valid_surrogate_pairs_are_ordinary_text(http: httpx.Client) -> None:
    raw = json.dumps(chat(messages=[{"role": "user", "content": "smile \ud83d\ude00"}]), ensure_ascii=True)
    assert post_raw(http, "/v1/chat/completions", raw).status_code == 200


# --- 2xx for invalid input: no coercion -----------------------------------------------------------------------

COERCED = [
    ("/v1/chat/completions", chat(max_tokens="16"), "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=True), "max_tokens"),
    ("/v1/chat/completions", chat(n="2"), "n"),
    ("/v1/chat/completions", chat(temperature="0.5"), "temperature"),
    ("/v1/chat/completions", chat(seed="7"), "seed"),
    ("/v1/chat/completions", chat(stream="yes"), "stream"),
    ("/v1/chat/completions", chat(stream=1), "stream"),
    ("/v1/chat/completions", chat(logprobs="on"), "logprobs"),
    (
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    ("/v1/completions", completion(echo="true"), "echo"),
    ("/v1/completions", completion(prompt=[True]), "prompt[0]"),
    ("/v1/completions", completion(n=1.5), "n"),
    ("/v1/chat/completions", chat(max_tokens=16.5), "max_tokens"),
    ("/v1/completions", completion(prompt=[1, 2.5]), "prompt[1]"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), COERCED, ids=[f"{c[2]}={next(iter(c[1].values()))}" for c in COERCED]
)
def test_values_of_the_wrong_type_are_invalid_type_not_coerced(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_400(http.post(path, json=body), param, "invalid_type")
    assert f"'{param}'" in error["message"]


WHOLE_NUMBER_FLOATS = [
    ("/v1/chat/completions", chat(n=1.0, max_tokens=2.0, seed=7.0, top_logprobs=2.0, logprobs=True)),
    ("/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=2.0, top_k=5.0, reasoning_effort=30.0)),
    ("/v1/completions", completion(n=1.0, max_tokens=2.0, logprobs=1.0, best_of=1.0)),
    ("/v1/completions", completion(prompt=[0.0, 300.0, 301.0], max_tokens=1e0)),
]


@pytest.mark.parametrize(("path", "body"), WHOLE_NUMBER_FLOATS, ids=["chat", "chat-more", "completions", "ids"])
def test_whole_number_floats_are_integers_as_in_openais_json_schema(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    """OpenAI's spec is JSON Schema, under which 16.0 is an integer: such requests are served as with 16."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    as_ints = {k: int(v) if isinstance(v, float) else v for k, v in body.items()}
    assert len(response.json()["choices"]) == len(http.post(path, json=as_ints).json()["choices"]) == 1


def test_whole_number_floats_are_integers_in_the_responses_api_too(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3.0, "seed": 7.0, "top_logprobs": 2.0}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["max_output_tokens"] == 3
    for wrong in (3.5, "3", True):  # a fraction, and no coercion: a string or a boolean is not an integer
        assert_400(
            http.post("/v1/responses", json={**body, "max_output_tokens": wrong}), "max_output_tokens", "invalid_type"
        )
    assert_400(http.post("/v1/responses", json={**body, "store": "false"}), "store", "invalid_type")


def test_a_fractional_integer_gets_openais_message(http: httpx.Client) -> None:
    error = assert_400(http.post("/v1/chat/completions", json=chat(max_tokens=16.5)), "max_tokens", "invalid_type")
    assert error["message"] == "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."


# --- 4xx for valid input ----------------------------------------------------------------------------------------

NULLABLE = [
    ("/v1/chat/completions", chat(n=None)),
    ("/v1/chat/completions", chat(stream=None)),
    ("/v1/chat/completions", chat(logprobs=None)),
    ("/v1/chat/completions", chat(temperature=None, top_p=None, stop=None, seed=None, max_tokens=None)),
    ("/v1/completions", completion(n=None)),
    ("/v1/completions", completion(stream=None)),
    ("/v1/completions", completion(echo=None)),
    ("/v1/completions", completion(prompt=None)),
    ("/v1/completions", completion(max_tokens=None, logprobs=None, suffix=None)),
]


@pytest.mark.parametrize(
    ("path", "body"),
    NULLABLE,
    ids=[
        f"{'chat' if 'chat' in p else 'completions'}-{','.join(k for k, v in b.items() if v is None)}"
        for p, b in NULLABLE
    ],
)
def test_null_where_openai_allows_it_means_the_default(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_top_p_zero_is_in_range_and_means_the_most_likely_token(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    greedy = client.chat.completions.create(**kwargs, temperature=0)
    for seed in (1, 2):
        reply = client.chat.completions.create(**kwargs, top_p=0, temperature=1.5, seed=seed)
        assert reply.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("role", ["system", "developer"])
def test_system_and_developer_messages_may_be_empty(client: openai.OpenAI, role: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": role, "content": ""}, *USER],
        max_tokens=2,  # type: ignore[misc,list-item]
    )
    assert reply.choices


# --- errors that say what is wrong ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (chat(stream=[1]), "stream", "invalid_type"),
        (chat(strawberry=1), "strawberry", "unknown_parameter"),
        (chat(string_field="x"), "string_field", "unknown_parameter"),
        (chat(integer=1), "integer", "unknown_parameter"),
        (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", "invalid_type"),
        (chat(stream=True, stream_options={"bogus": True}), "stream_options.bogus", "unknown_parameter"),
        (
            chat(messages=[*USER, *USER, {"role": "user", "content": [{"type": None}]}]),
            "messages[2].content[0].type",
            "invalid_value",
        ),
        (chat(messages=[{"role": "user", "content": [{"type": {}}]}]), "messages[0].content[0].type", "invalid_value"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages[0].content[0].text",
            None,
        ),
        (chat(messages=[{"role": "user", "content": []}]), "messages[0].content", None),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "invalid_value"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
        (chat(top_p=1.5), "top_p", "decimal_above_max_value"),
        (chat(n=0), "n", "integer_below_min_value"),
        (chat(messages=[]), "messages", "empty_array"),
        (chat(stop=5), "stop", "invalid_type"),
        (chat(tool_choice={"type": "function", "function": {"name": 5}}), "tool_choice.function.name", None),
        (chat(logit_bias={"5": "x"}), "logit_bias.5", "invalid_type"),
        ({"messages": USER}, "model", "missing_required_parameter"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_failure_names_the_full_parameter_path(
    http: httpx.Client, body: dict[str, Any], param: str, code: str | None
) -> None:
    error = assert_400(http.post("/v1/chat/completions", json=body), param, code)
    for python in ("None", "True", "False", "<class", "dict_", "list["):
        assert python not in error["message"], error["message"]
    if code == "unknown_parameter":
        assert param in error["message"]


def test_an_empty_body_says_so(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    error = assert_400(response, None)
    assert "None" not in error["message"] and "empty" in error["message"]


def test_long_values_are_cut_short_in_messages(http: httpx.Client) -> None:
    role = "w" * 100_000
    error = assert_400(
        http.post("/v1/chat/completions", json=chat(messages=[{"role": role, "content": "x"}])), "messages[0].role"
    )
    assert len(error["message"]) < 400


def test_405_names_the_allowed_methods(http: httpx.Client) -> None:
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["message"]


def test_json_sent_as_text_plain_is_told_about_the_content_type(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=json.dumps(chat()), headers={"content-type": "text/plain"})
    error = assert_400(response, None, "invalid_content_type")
    assert "application/json" in error["message"] and "text/plain" in error["message"]


def test_thinking_switches_take_booleans_only(http: httpx.Client) -> None:
    for value in ("false", 0, None, "true"):
        body = chat(chat_template_kwargs={"thinking": value})
        assert_400(http.post("/v1/chat/completions", json=body), "chat_template_kwargs.thinking", "invalid_value")
    body = chat(chat_template_kwargs={"enable_thinking": "no"})
    assert_400(http.post("/v1/chat/completions", json=body), "chat_template_kwargs.enable_thinking")


# --- requests nobody counted ----------------------------------------------------------------------------------


def _requests_total(http: httpx.Client) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "gateway_requests_total":
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_requests_rejected_before_any_backend_are_counted_with_their_status(http: httpx.Client) -> None:
    before = _requests_total(http)
    post_raw(http, "/v1/chat/completions", '{"model": "x", "messages": [')  # malformed JSON
    http.post("/v1/chat/completions", json=chat(max_tokens="16"))  # validation
    post_raw(http, "/v1/completions", json.dumps(completion(prompt="a@b")).replace("@", "\\ud800"))  # was a 500
    http.post("/v1/chat/completions", json=chat(response_format={"type": {}}))  # was a 500
    http.post("/v1/chat/completions", json=chat(model="no-such-model"))  # 404 unknown model
    http.get("/v1/models/no-such-model")
    http.get("/v1/chat/completions")  # 405
    after = _requests_total(http)

    def grew(status: str) -> float:
        key = tuple(sorted((*UNROUTED, ("status", status))))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("400") == 4
    assert grew("404") == 2
    assert grew("405") == 1


def test_a_404_for_a_huge_model_name_stays_small(http: httpx.Client, client: openai.OpenAI) -> None:
    name = "m" * 1_000_000
    for response in (
        http.post("/v1/chat/completions", json=chat(model=name)),
        http.post("/v1/completions", json=completion(model=name)),
        http.get(f"/v1/models/{'m' * 20_000}"),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
        assert len(response.content) < 1000
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=TINY_MODEL + "-missing", messages=USER)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def lmdeploy_fronted() -> Iterator[RunningGateway]:
    """A gateway whose only backend is an LMDeploy node that is not there: what it answers, it answers without
    asking any backend."""
    config = GatewayConfig(
        backends=[{"name": "lm", "kind": "lmdeploy", "urls": ["http://127.0.0.1:9"], "model": "m"}],
        models=[{"name": "lm-model", "backends": ["lm"]}],
    )
    running = start_gateway(config, wait_for="/health")
    yield running
    stop_gateway(running)


def test_lone_surrogates_are_refused_at_the_boundary_whatever_the_backend_kind(
    lmdeploy_fronted: RunningGateway,
) -> None:
    with httpx.Client(base_url=lmdeploy_fronted.base_url, timeout=30) as http:
        for path, body, param in [
            ("/v1/chat/completions", {**chat(model="lm-model"), "user": "a@b"}, "user"),
            ("/v1/completions", completion(model="lm-model", prompt=["a@b"]), "prompt[0]"),
        ]:
            raw = json.dumps(body).replace("@", "\\udfff")
            assert_400(post_raw(http, path, raw), param, "invalid_value")


@pytest.mark.parametrize("depth", [200, 900, 5000])
def test_deeply_nested_values_are_a_4xx_not_a_500(http: httpx.Client, depth: int) -> None:
    deep = "[" * depth + "]" * depth
    for body in (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": [{{"type": {deep}}}]}}]}}',
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "metadata": {{"k": {deep}}}}}',
        f'{{"model": "{MODEL}", "prompt": {deep}}}',
    ):
        path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
        response = post_raw(http, path, body)
        assert response.status_code == 400, response.text[:300]
        assert len(response.json()["error"]["message"]) < 400


class _BuggyBackend:
    """Test double for a backend with a programming error (no real backend has one we can trigger): generate
    raises something that is not a ``BackendError``."""

    kind = "test-double"

    def __init__(self, name: str) -> None:
        self.name = name

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def readiness(self) -> tuple[bool, str]:
        return True, "ready"

    def max_model_len(self) -> int | None:
        return None

    def generate(self, request):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug")


def _status_total(http: httpx.Client, status: str) -> float:
    return sum(value for labels, value in _requests_total(http).items() if ("status", status) in labels)


def test_a_500_is_counted_and_logged_too() -> None:
    config = GatewayConfig(
        backends=[{"name": "buggy", "kind": "reference"}], models=[{"name": "m", "backends": ["buggy"]}]
    )
    running = start_gateway(config, backends={"buggy": _BuggyBackend("buggy")})
    try:
        with httpx.Client(base_url=running.base_url, timeout=30) as http:
            before = _status_total(http, "500")
            with captured_logs(running) as logs:
                # A connection of its own: uvicorn closes the connection after an unhandled exception.
                response = httpx.post(f"{running.base_url}/v1/chat/completions", json={"model": "m", "messages": USER})
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "server_error"
            assert _status_total(http, "500") - before == 1, "counted once, by whoever saw it end"
        assert [line["status"] for line in logs if line.get("event") == "request"] == [500]
    finally:
        stop_gateway(running)

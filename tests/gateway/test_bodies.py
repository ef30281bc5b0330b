"""Large request bodies are parsed in a child process and behave exactly like small ones."""

from __future__ import annotations

import httpx

from gateway.bodies import OFFLOAD_BYTES, JSONBodyParser

from ..conftest import MODEL, RunningGateway


def parser_of(gateway: RunningGateway) -> JSONBodyParser:
    return gateway.app.state.json_parser


def test_a_large_chat_body_is_parsed_in_a_child_process(gateway: RunningGateway, http: httpx.Client) -> None:
    before = parser_of(gateway).offloaded
    content = "word " * (OFFLOAD_BYTES // 5 + 1000)
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": content}]}
    )
    assert response.status_code == 400  # parsed, validated and routed: then refused for the context window
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert parser_of(gateway).offloaded == before + 1


def test_a_small_body_is_parsed_in_place(gateway: RunningGateway, http: httpx.Client) -> None:
    before = parser_of(gateway).offloaded
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert response.status_code == 200
    assert parser_of(gateway).offloaded == before


def test_invalid_json_gets_the_same_error_whether_parsed_in_place_or_in_a_child(
    gateway: RunningGateway, http: httpx.Client
) -> None:
    def broken(size: int) -> httpx.Response:
        body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"a" * size
        return http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})

    before = parser_of(gateway).offloaded
    small, large = broken(10), broken(OFFLOAD_BYTES)
    assert parser_of(gateway).offloaded == before  # a body that fails to parse is not counted
    assert small.status_code == large.status_code == 400
    assert small.json()["error"]["type"] == large.json()["error"]["type"] == "invalid_request_error"
    assert small.json()["error"]["code"] == large.json()["error"]["code"]

"""Large request bodies are parsed in a child process and behave exactly like small ones."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.bodies import OFFLOAD_BYTES, JSONBodyParser, parse_json

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


EDGE_BODIES = [
    b'{"a": 1, "a": 2}',  # the last duplicate wins
    b'{"n": NaN, "i": Infinity, "m": -Infinity}',  # json only
    b'{"s": "\\ud800 lone"}',  # a lone surrogate: json only (the contract turns it into a 400 naming the field)
    b'{"big": 123456789012345678901234567890, "neg": -9223372036854775809}',  # past 64 bits: orjson reads floats
    b'{"max": 18446744073709551615, "min": -9223372036854775808, "in_text": "12345678901234567890"}',
    b'{"f": 1e400, "g": -0.0, "h": 0.1, "e": 2.5e-308}',
    '{"u": "é✓𝄞"}'.encode("utf-16"),  # not UTF-8: json only
    b'\xef\xbb\xbf{"bom": true}',
    b'  [1, 2.0, "x", null, true, false, {}]  ',
    '{"k": "é"}'.encode("latin-1"),  # invalid UTF-8: both refuse
    b'{"trailing": 1,}',
    b"",
]


@pytest.mark.parametrize("body", EDGE_BODIES)
def test_a_body_means_what_json_loads_says_it_means(body: bytes) -> None:
    def outcome(parse: Callable[[bytes], object]) -> object:
        try:
            return ("ok", repr(parse(body)))
        except (ValueError, RecursionError) as exc:
            return ("error", type(exc).__name__, str(exc))

    assert outcome(parse_json) == outcome(json.loads)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(json_values, st.booleans())
def test_any_json_document_parses_to_the_same_value(value: object, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert repr(parse_json(body)) == repr(json.loads(body))

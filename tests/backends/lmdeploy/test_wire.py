"""SSE framing, request translation and error mapping, on bytes taken from LMDeploy's transcripts (no server)."""

from __future__ import annotations

import pytest

from backends.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    UpstreamError,
    UpstreamProtocolError,
)
from backends.interface import Delta, Finish, GenerateRequest, SamplingOptions, TokenLogprob, ToolCallDelta
from backends.lmdeploy.errors import UpstreamFailure, failure_from_status
from backends.lmdeploy.stream import ChoiceStream, SSEReader, coalesce, token_text
from backends.lmdeploy.translate import plan_request
from gateway.routing.stream import counts_against_target, may_fall_back


class Pieces:
    def __init__(self, *pieces: bytes) -> None:
        self._pieces = list(pieces)

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


async def payloads(*pieces: bytes) -> list[bytes]:
    reader = SSEReader(Pieces(*pieces))
    out = []
    while (payload := await reader.next()) is not None:
        out.append(payload)
    return out


async def test_sse_events_split_across_reads_and_line_endings_are_reassembled() -> None:
    assert await payloads(b'data: {"a": 1}\n\nda', b'ta: {"b"', b": 2}\r\n\r\n", b"data: [DONE]\n\n") == [
        b'{"a": 1}',
        b'{"b": 2}',
        b"[DONE]",
    ]


async def test_sse_comments_are_skipped_and_multiline_data_joined() -> None:
    assert await payloads(b": ping\n\ndata: one\ndata: two\n\ndata:three") == [b"one\ntwo", b"three"]


def test_byte_level_vocabulary_spellings_become_text_and_real_bytes() -> None:
    assert token_text("Ġworld", list("Ġworld".encode()), True) == (" world", list(b" world"))
    assert token_text("ĊĊ", [], True) == ("\n\n", [10, 10])
    assert token_text("▁word", list("▁word".encode()), True) == ("▁word", list("▁word".encode()))
    assert token_text("Ġworld", [1], False) == ("Ġworld", [1])


def test_the_upstream_body_carries_only_known_fields_and_an_explicit_bound() -> None:
    request = GenerateRequest(
        request_id="r",
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        sampling=SamplingOptions(stop=["x y"], seed=5, min_tokens=2, min_p=0.1, repetition_penalty=1.2),
        thinking=True,
        reasoning_effort="high",
    )
    plan = plan_request(request, 4096)
    body = plan.body_for(1, "upstream")
    assert body["max_tokens"] == 4096 and body["seed"] == 6 and body["model"] == "upstream"
    assert body["min_new_tokens"] == 2 and body["min_p"] == 0.1 and body["repetition_penalty"] == 1.2
    assert body["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert "stop" not in body, "LMDeploy's token-level stop words would cut text OpenAI keeps"
    internal = {"session_id", "migration_request", "with_cache", "preserve_cache", "input_ids", "n"}
    assert not internal & body.keys()


def test_max_tokens_beyond_the_session_length_is_a_context_length_error() -> None:
    request = GenerateRequest(request_id="r", model="m", prompt="x", sampling=SamplingOptions(max_tokens=300))
    with pytest.raises(ContextLengthExceededError):
        plan_request(request, 256)


def test_max_tokens_that_only_bounds_the_output_is_cut_to_the_session_length() -> None:
    """``fit_context`` (the Messages API): LMDeploy ends the output at the session's end with ``length``."""
    fitted = SamplingOptions(max_tokens=32000, fit_context=True)
    request = GenerateRequest(request_id="r", model="m", messages=[{"role": "user", "content": "x"}], sampling=fitted)
    assert plan_request(request, 256).body["max_tokens"] == 256
    fitted.max_tokens = 100
    assert plan_request(request, 256).body["max_tokens"] == 100


@pytest.mark.parametrize(
    ("status", "body", "error", "param"),
    [
        (
            400,
            b'{"message":"The temperature -1.0 must be in [0, 2]","type":"invalid_request_error","code":400,'
            b'"param":null,"object":"error"}',
            InvalidRequestError,
            "temperature",
        ),
        (
            400,
            b'{"message":"Input length (4213) must be smaller than the model context length (4096).",'
            b'"type":"invalid_request_error","code":400,"param":null,"object":"error"}',
            ContextLengthExceededError,
            "messages",
        ),
        (
            404,
            b'{"message":"The model \'gpt-4o\' does not exist.","type":"not_found_error","code":404,"param":null,'
            b'"object":"error"}',
            ModelNotFoundError,
            None,
        ),
        (500, b"Internal Server Error", UpstreamError, None),
        (404, b'{"detail":"Not Found"}', UpstreamError, None),
    ],
    ids=["validation", "context-length", "unknown-model", "plain-text-500", "unknown-route"],
)
def test_flat_error_bodies_map_to_typed_errors(status: int, body: bytes, error: type, param: str | None) -> None:
    failure = failure_from_status(status, body, "http://node")
    assert type(failure.error) is error
    assert failure.error.param == param


async def test_a_carriage_return_split_from_its_line_feed_is_one_line_ending() -> None:
    assert await payloads(b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n") == [b"a", b"b"]


async def test_an_sse_event_past_the_size_bound_is_a_protocol_failure_of_the_node() -> None:
    reader = SSEReader(Pieces(b"data: " + b"x" * 100, b"x" * 100), max_event_bytes=150, node="n1")
    with pytest.raises(UpstreamFailure) as caught:
        await reader.next()
    assert isinstance(caught.value.error, UpstreamProtocolError) and caught.value.node_fault


@pytest.mark.parametrize(
    ("chat", "chunk"),
    [
        (True, b'{"choices":[1]}'),
        (True, b'{"usage":5}'),
        (True, b'{"usage":{"prompt_tokens":"many","completion_tokens":1}}'),
        (True, b'{"choices":[{"delta":{"content":5}}]}'),
        (True, b'{"choices":[{"delta":{},"finish_reason":7}]}'),
        (True, b'{"choices":[{"delta":{"tool_calls":[3]}}]}'),
        (False, b'{"text":5}'),
        (False, b'{"text":"a","meta_info":[1]}'),
    ],
)
def test_json_chunks_of_the_wrong_shape_are_protocol_failures_that_count_against_the_node(
    chat: bool, chunk: bytes
) -> None:
    stream = ChoiceStream(0, chat=chat, stops=[], want_top=0, byte_level=False, node="n1")
    with pytest.raises(UpstreamFailure) as caught:
        stream.feed(chunk)
    failure = caught.value
    assert failure.kind == "protocol" and failure.node_fault and failure.retryable  # node breaker, next node
    assert isinstance(failure.error, UpstreamProtocolError)
    # and for the gateway's routing: a target failure (breaker) that another target may serve (fallback)
    assert counts_against_target(failure.error) and may_fall_back(failure.error)


def test_text_deltas_read_together_become_one_but_tool_calls_finish_and_a_logprobs_mix_stay_apart() -> None:
    first = TokenLogprob("a", [97], -0.1, [])
    second = TokenLogprob("b", [98], -0.2, [])
    merged = coalesce([Delta(0, "a", [first], "r1")], [Delta(0, "b", [second]), Finish(0, "stop")])
    assert merged == [Delta(0, "ab", [first, second], "r1"), Finish(0, "stop")]
    call = Delta(0, "", None, "", [ToolCallDelta(0, "id", "f", "{")])
    assert coalesce([Delta(0, "x")], [call]) == [Delta(0, "x"), call], "a tool-call delta is never merged"
    assert coalesce([Delta(0, "x", [first])], [Delta(0, "y")]) == [Delta(0, "x", [first]), Delta(0, "y")]
    assert coalesce([Finish(0, "stop")], [Delta(0, "y")]) == [Finish(0, "stop"), Delta(0, "y")]
    assert coalesce([], [Delta(0, "y")]) == [Delta(0, "y")]
    assert coalesce([Delta(0, "", None, "r")], [Delta(0, "t")]) == [Delta(0, "t", None, "r")], "reasoning, then text"
    content_then_reasoning = [Delta(0, "t"), Delta(0, "", None, "r")]
    assert coalesce(content_then_reasoning[:1], content_then_reasoning[1:]) == content_then_reasoning, "order kept"

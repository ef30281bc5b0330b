"""Stream frames rendered from a pre-rendered prefix are the OpenAI chunks a client parses, whatever the text."""

from __future__ import annotations

import json

import pytest

from backends.interface import Delta, Finish, TokenLogprob, TopLogprob, Usage
from gateway.openai.output import ChatFormat, CompletionFormat

TEXTS = ["plain", "", 'quote " and \\ backslash', "line\nbreak\ttab\x00nul\x1f", "ünïcødé 漢字 🙂", "</script>"]


def parse(frame: bytes | None) -> dict:
    assert frame is not None
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and b"\n" not in frame[:-2]
    return json.loads(frame[6:])


def chat_chunk(fingerprint: str, choices: list[dict]) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": 'm"odel',
        "service_tier": "flex",
        "system_fingerprint": fingerprint,
        "choices": choices,
    }


@pytest.mark.parametrize("text", TEXTS)
def test_chat_text_frames_are_openai_chunks(text: str) -> None:
    fmt = ChatFormat("chatcmpl-1", 1700000000, 'm"odel', "fp_a", 12, "flex")
    first = parse(fmt.frame(Delta(11, "hi")))
    assert first == chat_chunk(
        "fp_a",
        [{"index": 11, "delta": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": None}],
    )
    for index in (11, 0):
        fmt.frame(Delta(index, "x"))  # the role goes out once per choice
        frame = parse(fmt.frame(Delta(index, text)))
        assert frame == chat_chunk(
            "fp_a", [{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
        )
    assert parse(fmt.frame(Finish(0, "length"))) == chat_chunk(
        "fp_a", [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    )
    assert parse(fmt.usage_frame(Usage(3, 4, 2, cached_tokens=1))) == {
        **chat_chunk("fp_a", []),
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 1},
            "prompt_cache_hit_tokens": 1,
            "prompt_cache_miss_tokens": 2,
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }


def test_chat_frames_follow_a_fingerprint_change() -> None:
    fmt = ChatFormat("chatcmpl-1", 1700000000, 'm"odel', "fp_a", 1, "priority")
    fmt.frame(Delta(0, "a"))
    fmt.fingerprint = "fp_b"
    frame = parse(fmt.frame(Delta(0, "b")))
    assert (frame["system_fingerprint"], frame["service_tier"]) == ("fp_b", "priority")
    response = fmt.response(None, False)
    assert (response["system_fingerprint"], response["service_tier"]) == ("fp_b", "priority")


def test_chat_frames_with_more_than_text_keep_their_fields() -> None:
    fmt = ChatFormat("chatcmpl-1", 1700000000, 'm"odel', "fp_a", 1)
    fmt.frame(Delta(0, "a"))
    logprobs = [TokenLogprob("b", [98], -0.5, [TopLogprob("b", [98], -0.5)])]
    frame = parse(fmt.frame(Delta(0, "", logprobs, reasoning="think")))
    assert frame["choices"] == [
        {
            "index": 0,
            "delta": {"content": None, "reasoning_content": "think"},
            "logprobs": {
                "content": [
                    {
                        "token": "b",
                        "logprob": -0.5,
                        "bytes": [98],
                        "top_logprobs": [{"token": "b", "logprob": -0.5, "bytes": [98]}],
                    }
                ],
                "refusal": None,
            },
            "finish_reason": None,
        }
    ]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_frames_are_openai_chunks(text: str) -> None:
    fmt = CompletionFormat("cmpl-1", 1700000000, "m", "fp_a", 12, "priority")
    head = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "service_tier": "priority",
        "system_fingerprint": "fp_a",
    }
    assert parse(fmt.frame(Delta(10, text))) == {
        **head,
        "choices": [{"index": 10, "text": text, "logprobs": None, "finish_reason": None}],
    }
    logprobs = [TokenLogprob("z", [122], -1.0, [])]
    frame = parse(fmt.frame(Delta(10, "z", logprobs)))
    assert frame["choices"][0]["logprobs"]["text_offset"] == [len(text)]  # the plain frame advanced the offset
    assert parse(fmt.frame(Finish(10, "stop"))) == {
        **head,
        "choices": [{"index": 10, "text": "", "logprobs": None, "finish_reason": "stop"}],
    }
    assert parse(fmt.usage_frame(Usage(1, 2))) == {
        **head,
        "choices": [],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
            "prompt_cache_hit_tokens": 0,
            "prompt_cache_miss_tokens": 1,
        },
    }

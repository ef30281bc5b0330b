"""Sampling parameters are accepted, normalized and rejected exactly as DeepInfer's ``SamplingParams`` does."""

from __future__ import annotations

from typing import Any

import pytest

from backends.reference import SamplingParams


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"temperature": -0.1}, ValueError),
        ({"temperature": float("nan")}, ValueError),
        ({"top_p": 0.0}, ValueError),
        ({"top_p": 1.5}, ValueError),
        ({"top_k": 0}, ValueError),
        ({"top_k": -2}, ValueError),
        ({"max_tokens": -1}, ValueError),
        ({"max_tokens": 2**31}, ValueError),
        ({"top_logprobs": -1}, ValueError),
        ({"top_logprobs": 1001}, ValueError),
        ({"temperature": 0.0, "top_p": 0.0}, ValueError),  # validated before the greedy rewrite
        ({"seq_seed": "7"}, TypeError),
        ({"seq_seed": 1.5}, TypeError),
        ({"stop": ["x"]}, TypeError),
        ({"n": 2}, TypeError),
    ],
)
def test_invalid_params_raise_like_deepinfer(params: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        SamplingParams.from_request(params)


def test_defaults_match_deepinfer() -> None:
    p = SamplingParams.from_request(None)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.top_logprobs) == (1.0, 1.0, -1, 16, 0)
    assert not p.ignore_eos and p.so_args is None and 0 <= p.seq_seed < 2**64


def test_so_args_are_kept_as_given_for_add_request_to_check() -> None:
    so_args = {"schema_type": "xml", "schema": "<a/>"}  # DeepInfer's SamplingParams does not look inside
    assert SamplingParams.from_request({"so_args": so_args}).so_args is so_args


def test_none_values_are_dropped_before_construction() -> None:
    p = SamplingParams.from_request({"temperature": None, "max_tokens": None, "seq_seed": None, "so_args": None})
    assert p.temperature == 1.0 and p.max_tokens == 16


def test_max_tokens_zero_becomes_one() -> None:
    assert SamplingParams.from_request({"max_tokens": 0}).max_tokens == 1


def test_seq_seed_is_masked_to_64_bits() -> None:
    assert SamplingParams.from_request({"seq_seed": -1}).seq_seed == 2**64 - 1
    assert SamplingParams.from_request({"seq_seed": 2**64 + 5}).seq_seed == 5


def test_temperature_below_1e_5_is_greedy_without_top_k_or_top_p() -> None:
    p = SamplingParams.from_request({"temperature": 0.0, "top_p": 0.5, "top_k": 3})
    assert p.greedy and p.temperature == 1e-5 and p.top_p == 1.0 and p.top_k == -1


def test_logprobs_flag_is_accepted_and_ignored() -> None:
    p = SamplingParams.from_request({"logprobs": True, "prompt_logprobs": True, "first_n_token_no_eos": 1})
    assert p.prompt_logprobs and p.first_n_token_no_eos == 1

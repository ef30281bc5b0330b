"""The reference engine behaves like DeepInfer's ``LLMEngine``: scheduling, stop rules, sampling, aborts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from backends.engine.protocol import Engine, EngineOutput
from backends.reference import ReferenceArtifacts, ReferenceEngine
from backends.reference.model import SMOOTHING, smoothed

MakeEngine = Callable[..., ReferenceEngine]


def chat_prompt(artifacts: ReferenceArtifacts, user: str = "Tell me about files.", answer: str = "") -> np.ndarray:
    text = f"<｜User｜>{user}<｜Assistant｜></think>{answer}"
    return np.array(artifacts.tokenizer.encode(text).ids, dtype=np.int32)


def thinking_prompt(artifacts: ReferenceArtifacts) -> np.ndarray:
    return np.array(artifacts.tokenizer.encode("<｜User｜>Why?<｜Assistant｜><think>").ids, dtype=np.int32)


def run(engine: ReferenceEngine, max_steps: int = 10_000) -> dict[str, list[EngineOutput]]:
    """Step until idle; outputs grouped per request, in order."""
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    return outputs


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [o.token_id for o in outputs]


def test_engine_satisfies_the_engine_protocol(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert isinstance(engine, Engine)
    assert engine.eos_id == 1 and engine.max_model_len == 4096 and engine.vocab_size > 8000


def test_same_seed_gives_same_tokens_alone_and_among_32_concurrent_requests(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    prompt = chat_prompt(artifacts)
    params = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 40, "seq_seed": 1234}
    alone = make_engine()
    alone.add_request("u", "target", params, prompt)
    expected = tokens(run(alone)["target"])

    crowded = make_engine()
    for i in range(16):
        crowded.add_request("u", f"before{i}", {"temperature": 1.3, "max_tokens": 5 + i, "seq_seed": i}, prompt)
    crowded.step()  # the target joins a batch that is already decoding, at a different row
    crowded.add_request("u", "target", params, prompt)
    for i in range(15):
        crowded.add_request("u", f"after{i}", {"top_k": 5, "max_tokens": 60, "seq_seed": 99 + i}, prompt)
    assert tokens(run(crowded)["target"]) == expected


def test_different_seeds_give_different_tokens(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    for seed in range(8):
        engine.add_request("u", f"r{seed}", {"max_tokens": 30, "seq_seed": seed}, chat_prompt(artifacts))
    assert len({tuple(tokens(outs)) for outs in run(engine).values()}) > 1


def test_greedy_is_deterministic_whatever_the_seed(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    for seed in range(4):
        engine.add_request(
            "u", f"r{seed}", {"temperature": 0, "max_tokens": 30, "seq_seed": seed}, chat_prompt(artifacts)
        )
    assert len({tuple(tokens(outs)) for outs in run(engine).values()}) == 1


def test_top_k_1_equals_greedy(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "greedy", {"temperature": 0, "max_tokens": 30}, chat_prompt(artifacts))
    engine.add_request("u", "topk", {"temperature": 1.0, "top_k": 1, "max_tokens": 30}, chat_prompt(artifacts))
    outs = run(engine)
    assert tokens(outs["greedy"]) == tokens(outs["topk"])
    assert all(o.token_logprob == 0.0 for o in outs["topk"])


@pytest.mark.parametrize("n", [1, 5, 20])
def test_top_logprobs_have_requested_length_and_descending_order(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, n: int
) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 20, "top_logprobs": n, "seq_seed": 3}, chat_prompt(artifacts))
    for out in run(engine)["r"]:
        assert len(out.top_logprobs) == n and len(out.top_token_ids) == n
        assert len(set(out.top_token_ids)) == n
        assert list(out.top_logprobs) == sorted(out.top_logprobs, reverse=True)
        assert all(-9999.0 <= lp <= 0.0 for lp in out.top_logprobs)
        if out.token_id in out.top_token_ids:
            assert out.top_logprobs[list(out.top_token_ids).index(out.token_id)] == out.token_logprob
        else:
            assert out.token_logprob <= out.top_logprobs[-1]


def test_top_logprobs_are_of_the_processed_distribution(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "greedy", {"temperature": 0, "max_tokens": 5, "top_logprobs": 4}, chat_prompt(artifacts))
    engine.add_request("u", "k2", {"top_k": 2, "max_tokens": 5, "top_logprobs": 4}, chat_prompt(artifacts))
    outs = run(engine)
    for out in outs["greedy"]:
        assert list(out.top_logprobs) == [0.0, -9999.0, -9999.0, -9999.0]
        assert out.top_token_ids[0] == out.token_id and out.token_logprob == 0.0
    for out in outs["k2"]:
        assert list(out.top_logprobs[2:]) == [-9999.0, -9999.0]
        assert np.isclose(np.exp(out.top_logprobs[:2]).sum(), 1.0)


def test_top_logprobs_are_capped_at_20(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 2, "top_logprobs": 1000}, chat_prompt(artifacts))
    assert all(len(o.top_logprobs) == 20 for o in run(engine)["r"])


def test_no_top_logprobs_requested_gives_empty_lists(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 3}, chat_prompt(artifacts))
    assert all(len(o.top_logprobs) == 0 == len(o.top_token_ids) for o in run(engine)["r"])


def test_max_tokens_finishes_with_length(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 7, "ignore_eos": True}, chat_prompt(artifacts))
    outs = run(engine)["r"]
    assert [o.num_output_tokens for o in outs] == list(range(1, 8))
    assert [o.finished for o in outs] == [False] * 6 + [True]
    assert outs[-1].finish_reason == "length" and all(o.finish_reason == "" for o in outs[:-1])
    assert all(o.prompt_len == len(chat_prompt(artifacts)) for o in outs)


def test_eos_finishes_with_stop_and_carries_token_1(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    for seed in range(8):
        engine.add_request("u", f"r{seed}", {"max_tokens": 2000, "seq_seed": seed}, chat_prompt(artifacts))
    for outs in run(engine).values():
        assert outs[-1].finish_reason == "stop" and outs[-1].token_id == 1
        assert 1 not in tokens(outs[:-1])


def test_answer_after_a_sentence_end_stops_at_once_unless_first_token_eos_is_masked(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    prompt = chat_prompt(artifacts, answer="Return True.")
    engine = make_engine()
    engine.add_request("u", "plain", {"temperature": 0, "max_tokens": 5}, prompt)
    engine.add_request("u", "masked", {"temperature": 0, "max_tokens": 5, "first_n_token_no_eos": 1}, prompt)
    outs = run(engine)
    assert tokens(outs["plain"]) == [1], "precondition: greedy ends the answer right after 'Return True.'"
    assert outs["masked"][0].token_id != 1


def test_ignore_eos_generates_past_eos(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    prompt = chat_prompt(artifacts, answer="Return True.")
    engine.add_request("u", "r", {"temperature": 0, "max_tokens": 4, "ignore_eos": True}, prompt)
    outs = run(engine)["r"]
    assert outs[0].token_id == 1 and not outs[0].finished
    assert len(outs) == 4 and outs[-1].finish_reason == "length"


def test_chat_answers_contain_no_markers_and_thinking_prompts_reason_then_answer(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    sp = artifacts.special
    markers = {sp.bos, sp.pad, sp.system, sp.user, sp.assistant, sp.latest_reminder, sp.think, sp.think_end}
    engine = make_engine()
    for seed in range(16):
        engine.add_request("u", f"chat{seed}", {"max_tokens": 300, "seq_seed": seed}, chat_prompt(artifacts))
        engine.add_request("u", f"think{seed}", {"max_tokens": 600, "seq_seed": seed}, thinking_prompt(artifacts))
    outs = run(engine)
    for seed in range(16):
        assert not markers & set(tokens(outs[f"chat{seed}"]))
    closed = [tokens(outs[f"think{seed}"]) for seed in range(16) if outs[f"think{seed}"][-1].finish_reason == "stop"]
    assert closed, "some thinking requests should finish within 600 tokens"
    for ids in closed:
        assert ids.count(sp.think_end) == 1 and ids.index(sp.think_end) < len(ids) - 1


def test_prompt_longer_than_max_model_len_finishes_prompt_length_exceeded(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine(max_model_len=8)
    prompt = np.arange(10, 19, dtype=np.int32)
    engine.add_request("u", "long", {"max_tokens": 5}, prompt)
    assert engine.get_num_unfinished_requests() == 1
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "prompt_length_exceeded"
    assert out.token_id == 18 and out.num_output_tokens == 1 and out.prompt_len == 9
    assert not engine.has_unfinished_requests()


def test_total_length_over_max_model_len_finishes_with_length(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=10)
    engine.add_request("u", "r", {"max_tokens": 100, "ignore_eos": True}, np.arange(10, 17, dtype=np.int32))
    engine.add_request("u", "full", {"max_tokens": 100, "ignore_eos": True}, np.arange(10, 20, dtype=np.int32))
    outs = run(engine)
    assert len(outs["r"]) == 4 and outs["r"][-1].finish_reason == "length"  # 7 + 4 > 10
    assert len(outs["full"]) == 1 and outs["full"][-1].finish_reason == "length"


def test_admission_is_capped_at_max_num_seqs(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request("u", f"r{i}", {"max_tokens": 3, "ignore_eos": True}, chat_prompt(artifacts))
    assert engine.get_num_unfinished_requests() == 5
    first = engine.step()
    assert [o.request_id for o in first] == ["r0", "r1"]
    engine.step()
    third = engine.step()
    assert {o.request_id for o in third if o.finished} == {"r0", "r1"}
    assert [o.request_id for o in engine.step()] == ["r2", "r3"]  # FIFO: the freed slots go to r2, r3
    assert set(run(engine)) == {"r2", "r3", "r4"}


def test_abort_while_waiting_emits_one_synthetic_abort_output(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    prompt = chat_prompt(artifacts)
    engine.add_request("u", "r", {"max_tokens": 5}, prompt)
    assert engine.abort_request("r") == (1, len(prompt))
    assert engine.has_unfinished_requests()
    (out,) = engine.step()
    assert out.request_id == "r" and out.finished and out.finish_reason == "abort"
    assert out.token_id == int(prompt[-1]) and out.num_output_tokens == 1 and out.token_logprob == 1.0
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_abort_while_running_emits_nothing_ever(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    prompt = chat_prompt(artifacts)
    engine.add_request("u", "r", {"max_tokens": 100, "ignore_eos": True}, prompt)
    engine.add_request("u", "other", {"max_tokens": 10, "ignore_eos": True}, prompt)
    engine.step()
    engine.step()
    assert engine.abort_request(["r", "missing"]) == (1, len(prompt) + 2)
    outs = run(engine)
    assert "r" not in outs and len(outs["other"]) == 8
    assert engine.flush_inflight_reqs() == []


def test_abort_of_unknown_or_finished_request_does_nothing(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 1}, chat_prompt(artifacts))
    run(engine)
    assert engine.abort_request("r") == (0, 0)
    assert engine.abort_request({"a", "b"}) == (0, 0)


@pytest.mark.parametrize(
    "prompt",
    [
        [5, 6, 7],
        np.array([5, 6, 7], dtype=np.int64),
        np.array([[5, 6, 7]], dtype=np.int32),
        np.arange(10, dtype=np.int32)[::2],
    ],
    ids=["list", "int64", "2-D", "strided"],
)
def test_prompt_must_be_a_contiguous_1d_int32_array(make_engine: MakeEngine, prompt: Any) -> None:
    with pytest.raises(TypeError):
        make_engine().add_request("u", "r", None, prompt)


def test_empty_prompt_raises(make_engine: MakeEngine) -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        make_engine().add_request("u", "r", None, np.array([], dtype=np.int32))


@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_out_of_range_token_ids_drop_the_request_silently(make_engine: MakeEngine, bad_id: int) -> None:
    engine = make_engine()
    assert engine.add_request("u", "r", None, np.array([0, 5, bad_id], dtype=np.int32)) is None
    assert engine.add_request("u", "edge", None, np.array([engine.vocab_size], dtype=np.int32)) is None
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_invalid_sampling_params_raise_from_add_request(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = np.array([0, 5], dtype=np.int32)
    with pytest.raises(TypeError):
        engine.add_request("u", "r", {"frequency_penalty": 0.5}, prompt)
    with pytest.raises(ValueError):
        engine.add_request("u", "r", {"top_k": 0}, prompt)
    with pytest.raises(ValueError, match="bound_token_ids"):  # more so_args cases: test_structured_output.py
        engine.add_request("u", "r", {"so_args": {"schema": "a+", "bound_token_ids": [1]}}, prompt)
    assert not engine.has_unfinished_requests()


def test_duplicate_live_request_id_raises_but_finished_ids_can_be_reused(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 2}, chat_prompt(artifacts))
    with pytest.raises(ValueError):
        engine.add_request("u", "r", {"max_tokens": 2}, chat_prompt(artifacts))
    run(engine)
    assert engine.add_request("u", "r", {"max_tokens": 2}, chat_prompt(artifacts)) is not None


def test_tokens_per_step_emits_several_tokens_per_request_and_drops_tokens_after_a_stop(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    single = make_engine()
    multi = make_engine(tokens_per_step=3)
    for engine in (single, multi):
        engine.add_request("u", "a", {"max_tokens": 8, "ignore_eos": True, "seq_seed": 1}, chat_prompt(artifacts))
        engine.add_request("u", "b", {"max_tokens": 8, "ignore_eos": True, "seq_seed": 2}, chat_prompt(artifacts))
    assert [o.request_id for o in multi.step()] == ["a", "b"]  # prefill: one token each
    second = multi.step()
    assert [o.request_id for o in second] == ["a"] * 3 + ["b"] * 3
    assert [o.num_output_tokens for o in second[:3]] == [2, 3, 4]
    rest = run(multi)
    assert [o.num_output_tokens for o in rest["a"]] == [5, 6, 7, 8]  # capped mid-step: the 9th is dropped
    assert rest["a"][-1].finish_reason == "length"
    single_out = run(single)
    assert [o.token_id for o in second if o.request_id == "a"] == tokens(single_out["a"])[1:4]


def test_timing_model_sleeps_at_least_the_configured_time(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine(prefill_seconds_per_token=0.002, decode_seconds_per_step=0.02)
    prompt = chat_prompt(artifacts)
    engine.add_request("u", "r", {"max_tokens": 3, "ignore_eos": True}, prompt)
    started = time.perf_counter()
    engine.step()
    assert time.perf_counter() - started >= 0.002 * len(prompt)
    started = time.perf_counter()
    engine.step()
    engine.step()
    assert time.perf_counter() - started >= 2 * 0.02


def test_engine_seed_makes_unseeded_requests_reproducible(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    runs = []
    for _ in range(2):
        engine = make_engine(seed=7)
        engine.add_request("u", "r", {"max_tokens": 20}, chat_prompt(artifacts))
        runs.append(tokens(run(engine)["r"]))
    assert runs[0] == runs[1]


def test_close_drops_everything(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    engine = make_engine()
    engine.add_request("u", "r", {"max_tokens": 20}, chat_prompt(artifacts))
    engine.step()
    engine.close()
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    with pytest.raises(RuntimeError):
        engine.add_request("u", "s", None, chat_prompt(artifacts))


def test_every_prompt_token_gets_a_finite_logprob(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    """A real model gives every token a finite logprob, so word perplexity over any text is finite (lm-eval's
    loglikelihood_rolling): tokens the model's tables never propose in a context get the background's share."""
    engine = make_engine()
    text = "Quantum zebras juggle marmalade while the accountant whistles Rachmaninoff backwards."
    prompt = np.array([0, *artifacts.tokenizer.encode(text, add_special_tokens=False).ids], dtype=np.int32)
    engine.add_request("u", "score", {"prompt_logprobs": True, "max_tokens": 1}, prompt)
    values = run(engine)["score"][0].prompt_logprobs
    assert values is not None and len(values) == prompt.size - 1
    background = engine.model.background()
    floor = float(np.log(SMOOTHING * background.min()))
    assert all(floor <= v < 0.0 for v in values), values
    unseen = [v for v in values if v < np.log(SMOOTHING)]  # outside (or at the tail of) the candidates
    assert unseen, "the sentence should hold tokens the model never proposes in their context"


def test_prompt_logprobs_of_a_sampled_continuation_are_the_logprobs_it_was_sampled_with(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    """At temperature 1 (no top-k/top-p) sampling draws from the model's candidates, so scoring what it drew
    agrees, including across the reasoning -> answer switch of a thinking prompt: scoring uses the smoothed model,
    ``(1 - SMOOTHING)`` times that distribution plus ``SMOOTHING`` times the background."""
    engine = make_engine()
    prompt = thinking_prompt(artifacts)
    params = {"temperature": 1.0, "max_tokens": 96, "seq_seed": 5, "ignore_eos": True}
    engine.add_request("u", "sample", params, prompt)
    sampled = run(engine)["sample"]
    assert all(o.prompt_logprobs is None for o in sampled)  # nobody asked
    think_end = artifacts.tokenizer.token_to_id("</think>")
    assert think_end in tokens(sampled)  # the continuation leaves the reasoning region
    scored_prompt = np.concatenate([prompt, np.array(tokens(sampled), dtype=np.int32)])
    engine.add_request("u", "score", {"prompt_logprobs": True, "max_tokens": 1}, scored_prompt)
    scored = run(engine)["score"]
    values = scored[0].prompt_logprobs
    assert values is not None and len(values) == scored_prompt.size - 1  # DeepInfer: prompt_len - 1 floats
    background = engine.model.background()
    expected = [np.log(smoothed(np.exp(o.token_logprob), background[o.token_id])) for o in sampled]
    assert values[-len(sampled) :] == pytest.approx(expected, abs=1e-9)
    assert all(o.prompt_logprobs is None for o in scored[1:])  # only on the prompt step's output


def test_outputs_keep_their_own_prompt_length_after_other_requests_leave_the_batch(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    prompts = {
        "short": chat_prompt(artifacts, "Hi."),
        "long": chat_prompt(artifacts, "Tell me everything about files, folders and disks, please."),
        "middle": chat_prompt(artifacts, "Tell me about folders."),
    }
    for rid, max_tokens in (("short", 1), ("long", 6), ("middle", 2)):
        engine.add_request("u", rid, {"max_tokens": max_tokens, "ignore_eos": True, "seq_seed": 1}, prompts[rid])
    outputs = run(engine)
    assert {rid: len(outs) for rid, outs in outputs.items()} == {"short": 1, "long": 6, "middle": 2}
    for rid, outs in outputs.items():
        assert {o.prompt_len for o in outs} == {int(prompts[rid].size)}, rid

"""Structured outputs in the reference engine: DeepInfer's ``so_args`` contract, enforced on the tiny model's output."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest

from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput, FinishReason
from backends.reference import ReferenceArtifacts, ReferenceEngine, SequenceStatus
from backends.reference.sampler import LOGPROB_FLOOR
from backends.reference.strict_schema import strict_json_schema
from backends.reference.structured import StructuredOutputs
from backends.reference.structured_state import FORCING, FREE, GRAMMAR, StructuredState

MakeEngine = Callable[..., ReferenceEngine]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "score", "address"],
}
ANSWER_REGEX = r"(yes|no), because [a-z ,]{10,60}\."
LIST_GRAMMAR = r"""
root ::= "[" item ("," item){0,5} "]"
item ::= "(" num " " op " " num ")" | word
num  ::= [1-9] [0-9]?
op   ::= "+" | "-" | "*"
word ::= [a-z]{1,12}
"""
LIST_LANGUAGE = re.compile(
    r"\[(\([1-9][0-9]? [-+*] [1-9][0-9]?\)|[a-z]{1,12})(,(\([1-9][0-9]? [-+*] [1-9][0-9]?\)|[a-z]{1,12})){0,5}\]"
)


def json_so(schema: dict[str, Any] = PERSON_SCHEMA, **extra: Any) -> dict[str, Any]:
    return {"schema_type": "json", "schema": json.dumps(schema), **extra}


def encode(artifacts: ReferenceArtifacts, text: str) -> list[int]:
    return artifacts.tokenizer.encode(text, add_special_tokens=False).ids


def chat_prompt(artifacts: ReferenceArtifacts) -> np.ndarray:
    text = "<｜User｜>Describe a person as JSON.<｜Assistant｜></think>"
    return np.array(artifacts.tokenizer.encode(text).ids, dtype=np.int32)


def thinking_prompt(artifacts: ReferenceArtifacts) -> np.ndarray:
    return np.array(artifacts.tokenizer.encode("<｜User｜>Why?<｜Assistant｜><think>").ids, dtype=np.int32)


def run(engine: ReferenceEngine, max_steps: int = 5_000) -> dict[str, list[EngineOutput]]:
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


def text_before_eos(artifacts: ReferenceArtifacts, outputs: list[EngineOutput]) -> str:
    """The generated text of a request that stopped on EOS (the EOS token itself is not text)."""
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].token_id == EOS_TOKEN_ID
    return artifacts.tokenizer.decode(tokens(outputs[:-1]), skip_special_tokens=False)


def run_seeds(
    make_engine: MakeEngine, prompt: np.ndarray, so_args: dict[str, Any], seeds: range, **params: Any
) -> dict[int, list[EngineOutput]]:
    engine = make_engine()
    for seed in seeds:
        engine.add_request("u", f"r{seed}", {"max_tokens": 400, "seq_seed": seed, **params, "so_args": so_args}, prompt)
    return {int(rid[1:]): outs for rid, outs in run(engine).items()}


# ---- the three schema types -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_json_schema_output_parses_and_validates_for_several_seeds(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, temperature: float
) -> None:
    results = run_seeds(make_engine, chat_prompt(artifacts), json_so(), range(8), temperature=temperature)
    documents = [json.loads(text_before_eos(artifacts, outs)) for outs in results.values()]
    for document in documents:
        jsonschema.validate(document, strict_json_schema(PERSON_SCHEMA))
    if temperature:
        assert len({json.dumps(d) for d in documents}) > 1  # seeds matter: the model, not a template, fills it


def test_json_schema_is_strict_like_xgrammar_no_undeclared_properties(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "inner": {"type": "object"}}}
    results = run_seeds(make_engine, chat_prompt(artifacts), json_so(schema), range(6))
    for outs in results.values():
        document = json.loads(text_before_eos(artifacts, outs))
        assert set(document) <= {"n", "inner"} and document.get("inner", {}) == {}


def test_regex_output_matches_the_whole_pattern(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    so_args = {"schema_type": "regex", "schema": ANSWER_REGEX}
    results = run_seeds(make_engine, chat_prompt(artifacts), so_args, range(8))
    texts = [text_before_eos(artifacts, outs) for outs in results.values()]
    assert all(re.fullmatch(ANSWER_REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1


def test_ebnf_grammar_output_is_in_the_language(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    so_args = {"schema_type": "ebnf", "schema": LIST_GRAMMAR}
    results = run_seeds(make_engine, chat_prompt(artifacts), so_args, range(8), max_tokens=1000)
    for outs in results.values():
        assert LIST_LANGUAGE.fullmatch(text_before_eos(artifacts, outs))


# ---- trigger and bound ------------------------------------------------------------------------------------


def test_trigger_leaves_text_free_until_the_trigger_then_applies_the_grammar(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    think_end = artifacts.special.think_end
    so_args = {"schema_type": "regex", "schema": ANSWER_REGEX, "trigger_token_ids": [think_end]}
    results = run_seeds(make_engine, thinking_prompt(artifacts), so_args, range(6), max_tokens=1000)
    for outs in results.values():
        ids = tokens(outs)
        cut = ids.index(think_end)
        reasoning = artifacts.tokenizer.decode(ids[:cut])
        assert reasoning and not re.fullmatch(ANSWER_REGEX, reasoning)  # free prose before the trigger
        assert re.fullmatch(ANSWER_REGEX, artifacts.tokenizer.decode(ids[cut + 1 : -1]))
        assert ids[-1] == EOS_TOKEN_ID


def test_bound_token_forces_the_whole_trigger_then_the_grammar(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    trigger = [artifacts.special.think_end, *encode(artifacts, "\nAnswer:")]  # never produced by the model itself
    period = encode(artifacts, ".")[0]
    so_args = {"schema_type": "regex", "schema": ANSWER_REGEX, "trigger_token_ids": trigger, "bound_token_id": period}
    results = run_seeds(make_engine, thinking_prompt(artifacts), so_args, range(6), max_tokens=1000, top_logprobs=2)
    for outs in results.values():
        ids = tokens(outs)
        cut = ids.index(period) + 1  # the first period of the reasoning is the bound
        assert ids[cut : cut + len(trigger)] == trigger
        forced = outs[cut : cut + len(trigger)]
        assert all(o.token_logprob == 0.0 and o.top_logprobs[1] == LOGPROB_FLOOR for o in forced)
        assert re.fullmatch(ANSWER_REGEX, artifacts.tokenizer.decode(ids[cut + len(trigger) : -1]))


def test_bound_token_that_starts_the_trigger_forces_only_the_rest(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    think_end = artifacts.special.think_end
    trigger = [think_end, *encode(artifacts, "\nAnswer:")]
    so_args = {
        "schema_type": "regex",
        "schema": ANSWER_REGEX,
        "trigger_token_ids": trigger,
        "bound_token_id": think_end,
    }
    results = run_seeds(make_engine, thinking_prompt(artifacts), so_args, range(4), max_tokens=1000)
    for outs in results.values():
        ids = tokens(outs)
        cut = ids.index(think_end)
        assert ids.count(think_end) == 1 and ids[cut : cut + len(trigger)] == trigger
        assert re.fullmatch(ANSWER_REGEX, artifacts.tokenizer.decode(ids[cut + len(trigger) : -1]))


def test_trigger_matching_handles_partial_matches_like_kmp() -> None:
    state = StructuredState(matcher=None, trigger=(5, 5, 6), bound=None)  # type: ignore[arg-type]
    for token in (5, 5, 5, 7, 5, 5, 5):
        assert state.advance(token, EOS_TOKEN_ID) and state.phase == FREE
    assert state.advance(6, EOS_TOKEN_ID) and state.phase == GRAMMAR


def test_bound_forces_what_remains_of_a_partly_matched_trigger() -> None:
    state = StructuredState(matcher=None, trigger=(5, 6, 7), bound=5)  # type: ignore[arg-type]
    assert state.advance(5, EOS_TOKEN_ID) and state.phase == FORCING and state.next_forced == 6
    assert state.advance(6, EOS_TOKEN_ID) and state.next_forced == 7
    assert state.advance(7, EOS_TOKEN_ID) and state.phase == GRAMMAR
    outside = StructuredState(None, (5, 6, 7), 9)  # type: ignore[arg-type]
    assert outside.advance(9, EOS_TOKEN_ID) and outside.forced == (5, 6, 7)  # a bound outside forces all of it
    assert not outside.advance(6, EOS_TOKEN_ID)  # anything but the forced token is a rejection


# ---- EOS ---------------------------------------------------------------------------------------------------


def test_eos_is_masked_until_the_grammar_completes_then_forced(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    results = run_seeds(make_engine, chat_prompt(artifacts), json_so(), range(4), top_logprobs=20)
    for outs in results.values():
        for out in outs[:-1]:
            assert out.token_id != EOS_TOKEN_ID
            assert all(
                t != EOS_TOKEN_ID or v == LOGPROB_FLOOR
                for t, v in zip(out.top_token_ids, out.top_logprobs, strict=True)
            )
        assert artifacts.tokenizer.decode(tokens(outs[:-1])).endswith("}")
        assert outs[-1].token_id == EOS_TOKEN_ID and outs[-1].token_logprob == 0.0  # the only choice left


def test_with_ignore_eos_generation_is_free_after_the_grammar_and_its_eos(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    so_args = {"schema_type": "regex", "schema": "(yes|no)"}
    results = run_seeds(make_engine, chat_prompt(artifacts), so_args, range(3), ignore_eos=True, max_tokens=30)
    for outs in results.values():
        ids = tokens(outs)
        end = ids.index(EOS_TOKEN_ID)
        assert artifacts.tokenizer.decode(ids[:end]) in ("yes", "no") and outs[end].token_logprob == 0.0
        assert len(ids) == 30 and outs[-1].finish_reason == FinishReason.LENGTH
        assert any(o.token_logprob < 0.0 for o in outs[end + 1 :])  # sampled from the model again, not forced


def test_first_n_token_no_eos_masks_eos_even_where_the_grammar_accepts_the_empty_string(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    so_args = {"schema_type": "regex", "schema": "(yes)?"}
    first = {}
    for no_eos in (0, 1):
        params = {"first_n_token_no_eos": no_eos, "top_logprobs": 5}
        outs = run_seeds(make_engine, chat_prompt(artifacts), so_args, range(1), **params)[0]
        first[no_eos] = dict(zip(outs[0].top_token_ids, outs[0].top_logprobs, strict=True))
        if no_eos:
            assert text_before_eos(artifacts, outs) == "yes"
    assert first[0][EOS_TOKEN_ID] > LOGPROB_FLOOR  # the grammar alone allows ending at once
    assert first[1].get(EOS_TOKEN_ID, LOGPROB_FLOOR) == LOGPROB_FLOOR


# ---- failures ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "so_args",
    [
        {"schema_type": "json", "schema": "{not json"},
        {"schema_type": "json", "schema": '{"type": "foo"}'},
        {"schema_type": "regex", "schema": "a(b"},
        {"schema_type": "regex", "schema": 5},
        {"schema_type": "ebnf", "schema": 'root ::= "a" (= "b") "b"'},  # xgrammar lookahead: not supported here
        {"schema_type": "ebnf", "schema": 'start: "a"'},  # Lark: not DeepInfer's dialect
        {"schema_type": "ebnf", "schema": 'item ::= "a"'},  # no root rule
        {"schema_type": "xml", "schema": "<a/>"},
        {"schema": "a+"},
        {"schema_type": "regex", "schema": "a+", "trigger_token_ids": [-1]},
        {"schema_type": "regex", "schema": "a+", "trigger_token_ids": "12"},
        {"schema_type": "regex", "schema": "a+", "trigger_token_ids": [10**6]},  # stricter: outside the vocabulary
        {"schema_type": "regex", "schema": "a+", "bound_token_id": 5},  # a bound needs a trigger
        {"schema_type": "regex", "schema": "a+", "trigger_token_ids": [5], "bound_token_id": -3},
    ],
)
def test_invalid_so_args_end_the_request_asynchronously_with_so_failed(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, so_args: dict[str, Any]
) -> None:
    engine = make_engine()
    prompt = chat_prompt(artifacts)
    seq = engine.add_request("u", "bad", {"so_args": so_args}, prompt)
    engine.add_request("u", "good", {"max_tokens": 3, "seq_seed": 1}, prompt)
    assert seq is not None and seq.status == SequenceStatus.FINISHED_SO_FAILED and seq.so_error
    assert engine.has_unfinished_requests() and engine.abort_request("bad") == (0, 0)  # like a pending compile
    outputs = run(engine)
    (out,) = outputs["bad"]
    assert out.finished and out.finish_reason == FinishReason.SO_FAILED == "xgrammar runtime errors or timeout"
    assert (out.token_id, out.token_logprob, out.num_output_tokens) == (int(prompt[-1]), 1.0, 1)
    assert len(outputs["good"]) == 3


@pytest.mark.parametrize(
    ("so_args", "error"),
    [
        ({"schema_type": "json", "schema": "{}", "serialized": b"..."}, ValueError),
        ({"schema_type": "json", "schema": "{}", "trigger_token_ids": [5], "bound_token_ids": [1]}, ValueError),
        ({"schema_type": "json"}, KeyError),
        ("json", TypeError),
    ],
)
def test_rejected_so_args_raise_from_add_request(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, so_args: Any, error: type[Exception]
) -> None:
    engine = make_engine()
    with pytest.raises(error):
        engine.add_request("u", "r", {"so_args": so_args}, chat_prompt(artifacts))
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_structured_requests_are_abortable_at_once_since_compiling_is_synchronous(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    engine.add_request("u", "waiting", {"so_args": json_so()}, chat_prompt(artifacts))
    assert engine.abort_request("waiting") == (1, len(chat_prompt(artifacts)))  # DeepInfer: (0, 0) while compiling
    engine.add_request("u", "running", {"max_tokens": 50, "so_args": json_so()}, chat_prompt(artifacts))
    first = engine.step()
    assert [o.finish_reason for o in first] == [FinishReason.ABORT, ""]
    assert engine.abort_request("running")[0] == 1
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_grammar_rejecting_a_token_mid_generation_ends_with_token_zero(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    engine = make_engine()
    golden = [*encode(artifacts, "12"), *encode(artifacts, "hello")]  # teacher forcing out of the grammar
    so_args = {"schema_type": "regex", "schema": "[0-9]+"}
    engine.add_request(
        "u", "r", {"golden_token_ids": golden, "max_tokens": 20, "so_args": so_args}, chat_prompt(artifacts)
    )
    outs = run(engine)["r"]
    digits = len(encode(artifacts, "12"))
    assert tokens(outs[:digits]) == golden[:digits] and not any(o.finished for o in outs[:digits])
    last = outs[digits]
    assert len(outs) == digits + 1 and last.finished and last.finish_reason == FinishReason.SO_FAILED
    assert (last.token_id, last.token_logprob, last.num_output_tokens) == (0, 1.0, digits + 1)
    assert last.top_logprobs == () or list(last.top_logprobs) == []


# ---- batching, determinism, cost ---------------------------------------------------------------------------


def test_structured_rows_leave_the_other_rows_of_the_batch_unchanged(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    prompt = chat_prompt(artifacts)
    plain = {f"p{i}": {"max_tokens": 40, "seq_seed": 100 + i, "temperature": 0.8, "top_logprobs": 3} for i in range(6)}
    alone = make_engine()
    for rid, params in plain.items():
        alone.add_request("u", rid, params, prompt)
    expected = run(alone)

    mixed = make_engine()
    for i, (rid, params) in enumerate(plain.items()):
        mixed.add_request("u", rid, params, prompt)
        mixed.add_request(
            "u", f"so{i}", {"max_tokens": 40, "seq_seed": i, "top_logprobs": 3, "so_args": json_so()}, prompt
        )
    got = run(mixed)
    assert {rid: got[rid] for rid in plain} == expected
    assert any(o.token_logprob == 0.0 for o in got["so0"])  # the structured rows really were constrained


def test_seeded_structured_output_is_the_same_alone_and_in_a_crowd(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    prompt = chat_prompt(artifacts)
    params = {"max_tokens": 200, "seq_seed": 42, "temperature": 0.9, "top_p": 0.95, "so_args": json_so()}
    alone = make_engine()
    alone.add_request("u", "target", params, prompt)
    expected = run(alone)["target"]

    crowded = make_engine()
    for i in range(10):
        extra = {"so_args": {"schema_type": "regex", "schema": ANSWER_REGEX}} if i % 2 else {}
        crowded.add_request("u", f"other{i}", {"max_tokens": 5 + 3 * i, "seq_seed": i, **extra}, prompt)
    crowded.step()
    crowded.add_request("u", "target", params, prompt)
    assert run(crowded)["target"] == expected


def test_several_tokens_per_step_give_the_same_structured_output(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts
) -> None:
    prompt = chat_prompt(artifacts)
    outputs = []
    for per_step in (1, 3):
        engine = make_engine(tokens_per_step=per_step)
        for seed in range(4):
            engine.add_request("u", f"r{seed}", {"max_tokens": 300, "seq_seed": seed, "so_args": json_so()}, prompt)
        outputs.append({rid: tokens(outs) for rid, outs in run(engine).items()})
    assert outputs[0] == outputs[1]


def test_repeated_schemas_compile_once(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[str] = []
    original = StructuredOutputs._build

    def counting(self: StructuredOutputs, schema_type: str, schema: str) -> Any:
        builds.append(schema)
        return original(self, schema_type, schema)

    monkeypatch.setattr(StructuredOutputs, "_build", counting)
    engine = make_engine()
    for i in range(5):
        engine.add_request("u", f"ok{i}", {"max_tokens": 4, "so_args": json_so()}, chat_prompt(artifacts))
        engine.add_request("u", f"bad{i}", {"so_args": {"schema_type": "regex", "schema": "("}}, chat_prompt(artifacts))
    assert len(builds) == 2
    outputs = run(engine)
    assert all(outputs[f"bad{i}"][-1].finish_reason == FinishReason.SO_FAILED for i in range(5))
    assert all(len(outputs[f"ok{i}"]) == 4 for i in range(5))


def test_logprobs_are_those_of_the_masked_distribution(make_engine: MakeEngine, artifacts: ReferenceArtifacts) -> None:
    results = run_seeds(make_engine, chat_prompt(artifacts), json_so(), range(3), max_tokens=1, top_logprobs=20)
    for (out,) in results.values():
        live = [t for t, v in zip(out.top_token_ids, out.top_logprobs, strict=True) if v > LOGPROB_FLOOR]
        assert live and all(artifacts.tokenizer.decode([t]).startswith("{") for t in live)  # JSON starts with {
        assert sum(np.exp(v) for v in out.top_logprobs) == pytest.approx(1.0)


def test_strict_json_schema_closes_objects_and_arrays_without_touching_property_names() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object"},
            "items": {"type": "array", "prefixItems": [{"type": "object"}]},
        },
        "$defs": {"open": {"type": "object", "additionalProperties": True}},
        "anyOf": [{"properties": {"a": {"type": "array", "items": {"type": "string"}}}}],
    }
    strict = strict_json_schema(schema)
    assert strict["additionalProperties"] is False and set(strict["properties"]) == {"properties", "items"}
    assert strict["properties"]["properties"]["additionalProperties"] is False
    assert strict["properties"]["items"]["items"] is False
    assert strict["properties"]["items"]["prefixItems"][0]["additionalProperties"] is False
    assert strict["$defs"]["open"]["additionalProperties"] is True
    assert strict["anyOf"][0]["additionalProperties"] is False
    assert strict["anyOf"][0]["properties"]["a"]["items"] == {"type": "string"}
    assert "additionalProperties" not in schema  # the caller's schema is not modified


def test_report_per_token_cost_with_and_without_structured_output(
    make_engine: MakeEngine, artifacts: ReferenceArtifacts, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reports (never asserts) decode time per token; a long string keeps every row under its grammar."""
    prompt = chat_prompt(artifacts)
    long_text = json_so({"type": "object", "properties": {"text": {"type": "string", "minLength": 10_000}}})
    steps = 40
    report = []
    for batch in (1, 64):
        per_token = {}
        for label, extra in (("plain", {}), ("json", {"so_args": long_text})):
            engine = make_engine()
            for i in range(batch):
                engine.add_request(
                    "u", f"r{i}", {"max_tokens": steps + 1, "seq_seed": i, "ignore_eos": True, **extra}, prompt
                )
            engine.step()  # admission and first token
            started = time.perf_counter()
            emitted = sum(len(engine.step()) for _ in range(steps))
            per_token[label] = (time.perf_counter() - started) / emitted
            assert emitted == batch * steps
        report.append(f"batch {batch}: " + ", ".join(f"{k} {v * 1e6:.1f} us/token" for k, v in per_token.items()))
    with capsys.disabled():
        print("\nstructured-output cost: " + "; ".join(report))

"""The binding (``backends.deepinfer.engine``) on DeepInfer's real engine, driven as ``EngineDriver`` drives it.

The stub model samples each request's prompt back after its BOS, then EOS (id 1); everything else is DeepInfer's:
its scheduler, zero-overhead scheduling (ZOS), output pool, aborts and flush.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.deepinfer.engine import DeepInferEngine
from backends.engine.protocol import EngineOutput

from .conftest import forwards, outputs_of, start

ZOS = pytest.mark.parametrize("zos", ["1", "0"], ids=["zos", "no-zos"])


def ids(engine: DeepInferEngine, text: str = "alpha beta gamma") -> np.ndarray:
    return np.asarray(engine.tokenizer.encode(text).ids, dtype=np.int32)


def add(engine: DeepInferEngine, request_id: str, prompt: np.ndarray, **params: Any) -> object | None:
    return engine.add_request("user", request_id, {"max_tokens": 64, **params}, prompt)


def steps_until_idle(engine: DeepInferEngine, limit: int = 500) -> list[list[EngineOutput]]:
    """The driver's loop without the flush: each ``step()``'s outputs while the engine reports work."""
    per_step: list[list[EngineOutput]] = []
    while engine.has_unfinished_requests():
        per_step.append(engine.step())
        assert len(per_step) < limit, "the engine never went idle"
    return per_step


def run(engine: DeepInferEngine) -> list[EngineOutput]:
    """The driver's loop: step while the engine has work, then flush once."""
    outputs = [o for step in steps_until_idle(engine) for o in step]
    return outputs + engine.flush_inflight_reqs()


def test_outputs_are_plain_records_that_outlive_the_next_step(real_model_dir: Path) -> None:
    engine = start(real_model_dir)
    prompt = ids(engine)
    add(engine, "a", prompt)
    first = engine.step()
    later = engine.step() + engine.step()  # DeepInfer returns the pointers behind `first` to its pool here
    assert first and all(type(o) is EngineOutput for o in first)
    assert (first[0].request_id, first[0].token_id, first[0].prompt_len) == ("a", int(prompt[1]), len(prompt))
    rest = later + run(engine)
    text = engine.tokenizer.decode([o.token_id for o in first + rest])
    assert text == "alpha beta gamma"
    assert (rest[-1].finished, rest[-1].finish_reason, rest[-1].token_id) == (True, "stop", 1)
    engine.close()


@ZOS
def test_last_output_comes_from_step_one_step_late_under_zos(real_model_dir: Path, zos: str) -> None:
    """DeepInfer returns a finished request's last output from ``step()`` (ZOS: from the step after the one that
    sampled it); it still counts the request as unfinished until the next step, and flush then has nothing."""
    engine = start(real_model_dir, env={"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": zos})
    add(engine, "a", ids(engine), max_tokens=5, ignore_eos=True)
    per_step = steps_until_idle(engine)
    counts = [len(outputs) for outputs in per_step]
    if zos == "1":  # prefill at once; each decode token one step late; then the extra step
        assert counts == [1, 0, 1, 1, 1, 1, 0]
    else:
        assert counts == [1, 1, 1, 1, 1, 0]
    final = per_step[-2][-1]
    assert (final.finished, final.finish_reason, final.num_output_tokens) == (True, "length", 5)
    assert not any(o.finished for step in per_step[:-2] for o in step)
    assert engine.flush_inflight_reqs() == [], "nothing is in flight once the engine reports no work"
    assert engine.get_num_unfinished_requests() == 0
    engine.close()


def test_flush_mid_decode_returns_the_in_flight_step_without_duplicates(real_model_dir: Path) -> None:
    engine = start(real_model_dir, env={"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"})
    add(engine, "a", ids(engine), max_tokens=6, ignore_eos=True)
    got = engine.step() + engine.step() + engine.step()
    flushed = engine.flush_inflight_reqs()
    assert [o.request_id for o in flushed] == ["a"] and not flushed[0].finished
    assert engine.flush_inflight_reqs() == []
    rest = run(engine)
    tokens = [o.num_output_tokens for o in got + flushed + rest]
    assert tokens == [1, 2, 3, 4, 5, 6], "every token once, in order"
    engine.close()


@ZOS
def test_aborted_running_request_emits_nothing_more(real_model_dir: Path, zos: str) -> None:
    engine = start(real_model_dir, env={"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": zos})
    add(engine, "a", ids(engine), max_tokens=100, ignore_eos=True)
    for _ in range(4):
        engine.step()
    aborted, _length = engine.abort_request(["a"])
    assert aborted == 1
    assert run(engine) == [], "no abort output and no in-flight token for a running request"
    assert engine.get_num_unfinished_requests() == 0
    assert engine.statistics.aborted == 1
    engine.close()


@ZOS
def test_aborted_waiting_request_emits_one_abort_output(real_model_dir: Path, zos: str) -> None:
    engine = start(real_model_dir, max_num_seqs=1, env={"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": zos})
    prompt = ids(engine)
    add(engine, "running", prompt, max_tokens=50, ignore_eos=True)
    add(engine, "waiting", prompt, max_tokens=50, ignore_eos=True)
    assert [o.request_id for o in engine.step()] == ["running"], "max_num_seqs=1: the second one waits"
    assert engine.abort_request(["running", "waiting"])[0] == 2
    outputs = run(engine)
    assert outputs_of(outputs) == [("waiting", int(prompt[-1]), True, "abort")]
    assert (outputs[0].num_output_tokens, outputs[0].prompt_len) == (1, len(prompt))
    engine.close()


def test_request_added_while_others_decode_is_prefilled_at_the_next_step(real_model_dir: Path) -> None:
    """With ``DEEPINFER_PREFILL_ATTEMPT_INTERVAL=1`` (ENGINE_ENV) DeepInfer tries a prefill at every step; its
    default (70) would make a request that arrives mid-decode wait up to 70 steps (test_prefill_admission.py)."""
    engine = start(real_model_dir)
    add(engine, "a", ids(engine), max_tokens=40, ignore_eos=True)
    for _ in range(5):
        engine.step()
    add(engine, "late", ids(engine, "delta"), max_tokens=3, ignore_eos=True)
    late_after = None
    for step in range(1, 10):
        if any(o.request_id == "late" for o in engine.step()):
            late_after = step
            break
    assert late_after == 1, "its first token comes from the very next step"
    assert forwards(engine)[-1] == (True, ["late"]), "a prefill step of its own"
    run(engine)
    engine.close()


def test_token_ids_outside_the_vocabulary_are_dropped(real_model_dir: Path) -> None:
    engine = start(real_model_dir)
    assert add(engine, "a", np.array([5, engine.vocab_size], dtype=np.int32)) is None
    assert engine.get_num_unfinished_requests() == 0
    engine.close()


def test_prompt_ids_are_passed_as_contiguous_int32(real_model_dir: Path) -> None:
    engine = start(real_model_dir)
    prompt = np.asarray(ids(engine), dtype=np.int64)[::-1][::-1]
    assert add(engine, "a", prompt) is not None
    with pytest.raises(ValueError, match="int32"):
        add(engine, "b", np.array([2**40], dtype=np.int64))
    assert run(engine)[-1].finish_reason == "stop"
    engine.close()


def test_statistics_follow_the_scheduler(real_model_dir: Path) -> None:
    engine = start(real_model_dir, max_num_seqs=2)
    for i in range(3):
        add(engine, f"r{i}", ids(engine), max_tokens=50, ignore_eos=True)
    engine.step()
    stats = engine.statistics
    assert (stats.running, stats.waiting) == (2, 1)
    assert 0 < stats.kv_cache_usage < 1
    run(engine)
    assert engine.statistics.running == engine.statistics.waiting == 0
    assert engine.statistics.kv_cache_usage == 0
    engine.close()


def test_finished_payload_is_trimmed_when_stats_logging_is_off(real_model_dir: Path) -> None:
    engine = start(real_model_dir)
    for i in range(3):
        add(engine, f"r{i}", ids(engine))
    run(engine)
    assert engine.llm_engine.num_finished_completion == 3
    assert engine.llm_engine.finished_payload == []
    engine.close()

"""The TEST DOUBLE of ``deepinfer`` enforces the traps of the fact sheet, so the binding's tests cannot pass by luck.

These tests drive the double directly, the way a careless binding would, and show each trap springs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.usefixtures("deepinfer_double")


def build(model_dir: Path, *, devices: str | None = "0", **overrides: Any) -> Any:
    from deepinfer.engine.arg_utils import EngineArgs
    from deepinfer.engine.llm_engine import LLMEngine

    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    fields: dict[str, Any] = {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN}
    fields.update(overrides)
    return LLMEngine.from_engine_args(EngineArgs(**fields))


def prompt(engine: Any, text: str = "alpha beta gamma") -> np.ndarray:
    return np.asarray(engine.tokenizer.encode(text), dtype=np.int32)


def request_ids(pointers: np.ndarray) -> list[str]:
    import torch  # noqa: F401  # deepinfer._C loads only once torch has
    from deepinfer._C.engine import RequestOutput

    return [RequestOutput.get_request_id(p) for p in pointers.tolist()]


def test_output_pointers_die_at_the_next_step(model_dir: Path) -> None:
    import torch  # noqa: F401  # deepinfer._C loads only once torch has
    from deepinfer._C.engine import RequestOutput

    engine = build(model_dir)
    engine.add_request(user_id="u", request_id="a", sampling_params={"max_tokens": 8}, prompt_token_ids=prompt(engine))
    first = engine.step()
    assert RequestOutput.get_request_id(int(first[0])) == "a"
    engine.step()
    with pytest.raises(RuntimeError, match="stale"):
        RequestOutput.get_token_id(int(first[0]))


def test_last_output_comes_from_step_and_the_request_counts_until_the_next_step(model_dir: Path) -> None:
    """As DeepInfer's real engine (tests/backends/deepinfer/real/test_engine.py): the final output comes from
    ``step()``, one step late under zero-overhead scheduling, then one more step; flush has nothing left."""
    import torch  # noqa: F401  # deepinfer._C loads only once torch has
    from deepinfer._C.engine import RequestOutput

    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"  # one token per step, as on the real engine's stub model
    engine = build(model_dir)
    engine.add_request(user_id="u", request_id="a", sampling_params={"max_tokens": 5}, prompt_token_ids=prompt(engine))
    per_step: list[list[tuple[bool, str]]] = []
    while engine.has_unfinished_requests():
        pointers = engine.step().tolist()  # read at once: the next step frees them
        per_step.append([(RequestOutput.get_finished(p), RequestOutput.get_finish_reason(p)) for p in pointers])
    assert [len(outputs) for outputs in per_step] == [1, 0, 1, 1, 1, 1, 0]
    assert per_step[-2] == [(True, "length")]
    assert len(engine.flush_inflight_reqs()) == 0


def test_running_abort_emits_nothing_and_waiting_abort_emits_a_synthetic_output(model_dir: Path) -> None:
    import torch  # noqa: F401  # deepinfer._C loads only once torch has
    from deepinfer._C.engine import RequestOutput

    engine = build(model_dir, max_num_seqs=1)
    ids = prompt(engine)
    for rid in ("running", "waiting"):
        engine.add_request(user_id="u", request_id=rid, sampling_params={"max_tokens": 50}, prompt_token_ids=ids)
    assert request_ids(engine.step()) == ["running"]  # max_num_seqs=1: the second one waits
    assert engine.abort_request(["running", "waiting"])[0] == 2
    outputs: list[Any] = []
    while engine.has_unfinished_requests():
        outputs += [RequestOutput.clone(p) for p in engine.step().tolist()]
    outputs += [RequestOutput.clone(p) for p in engine.flush_inflight_reqs().tolist()]
    assert [o.request_id for o in outputs] == ["waiting"]
    assert outputs[0].finish_reason == "abort"
    assert outputs[0].token_id == int(ids[-1]), "a synthetic output repeats the last prompt token"


def test_add_request_rejections(model_dir: Path) -> None:
    engine = build(model_dir)
    vocab = engine.model_config.get_vocab_size()
    add = engine.add_request
    assert add(user_id="u", request_id="a", sampling_params={}, prompt_token_ids=np.array([3, vocab], np.int32)) is None
    with pytest.raises(ValueError, match="empty"):
        add(user_id="u", request_id="b", sampling_params={}, prompt_token_ids=np.array([], np.int32))
    with pytest.raises(TypeError):
        add(user_id="u", request_id="c", sampling_params={}, prompt_token_ids=np.array([3, 4], np.int64))
    with pytest.raises(TypeError):
        add(user_id="u", request_id="d", sampling_params={"best_of": 2}, prompt_token_ids=prompt(engine))
    with pytest.raises(ValueError, match="top_p"):
        add(user_id="u", request_id="e", sampling_params={"top_p": 0.0}, prompt_token_ids=prompt(engine))


def test_grammar_compiles_are_invisible_to_abort(model_dir: Path) -> None:
    engine = build(model_dir)
    so = {"so_args": {"schema_type": "json", "schema": "{}"}, "max_tokens": 4}
    engine.add_request(user_id="u", request_id="g", sampling_params=so, prompt_token_ids=prompt(engine))
    assert engine.abort_request("g") == (0, 0)
    produced: list[str] = []
    while engine.has_unfinished_requests():
        produced += request_ids(engine.step())
    produced += request_ids(engine.flush_inflight_reqs())
    assert "g" in produced, "the request ran although it was aborted while compiling"


def test_construction_needs_visible_devices_and_sm100(model_dir: Path) -> None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    with pytest.raises(KeyError):
        build(model_dir, devices=None)
    os.environ["DEEPINFER_DOUBLE_DEVICE"] = "sm90"
    with pytest.raises(RuntimeError, match="unknown GPU type"):
        build(model_dir)


def test_engine_args_default_max_model_len_is_4096(model_dir: Path) -> None:
    assert build(model_dir, max_model_len=None).model_config.max_model_len == 4096


def test_engine_refuses_a_second_thread(model_dir: Path) -> None:
    import threading

    engine = build(model_dir)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            engine.step()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "one thread" in str(errors[0])

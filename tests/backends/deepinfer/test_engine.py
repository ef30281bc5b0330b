"""The DeepInfer binding (``backends.deepinfer``) against the TEST DOUBLE of ``deepinfer``: only what DeepInfer's real
engine cannot show on this machine (the hardware gate, KV-cache pressure, speculative decoding, structured outputs,
what the process environment held at import). Everything else runs on the real engine: ``real/test_engine.py``.

Each test builds the engine with the binding's own ``start_engine`` on the test thread and drives the adapter the
way ``EngineDriver`` does: step while there is work, flush once when idle.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.deepinfer.engine import DeepInferEngine
from backends.deepinfer.startup import DeepInferStartupError, start_engine
from backends.engine.protocol import EngineOutput
from backends.errors import UpstreamError

from .conftest import MAX_MODEL_LEN, make_config

pytestmark = pytest.mark.usefixtures("deepinfer_double")


def start(model_dir: Path, **overrides: Any) -> DeepInferEngine:
    return start_engine(make_config(model_dir, **overrides))


def ids(engine: DeepInferEngine, text: str = "alpha beta gamma") -> np.ndarray:
    return np.asarray(engine.tokenizer.encode(text).ids, dtype=np.int32)


def run(engine: DeepInferEngine) -> list[EngineOutput]:
    """The driver's loop: step while the engine has work, then flush once."""
    outputs: list[EngineOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.flush_inflight_reqs()
    return outputs


def add(engine: DeepInferEngine, request_id: str, prompt: np.ndarray, **params: Any) -> object | None:
    return engine.add_request("user", request_id, {"max_tokens": 64, **params}, prompt)


def test_environment_is_set_before_deepinfer_is_imported(model_dir: Path) -> None:
    assert "deepinfer" not in sys.modules
    engine = start(model_dir, env={"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"}, visible_devices="3")
    import deepinfer

    assert deepinfer.IS_TEST_DOUBLE
    seen_at_import = deepinfer.IMPORT_ENVIRON
    assert seen_at_import["CUDA_VISIBLE_DEVICES"] == "3"
    assert seen_at_import["DEEPINFER_USE_MULTIMODAL_POOL"] == "0"
    assert seen_at_import["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == "1"
    llm = engine.llm_engine
    assert llm.scheduler_config.prefill_attempt_interval == 1, "read at import time by SchedulerConfig"
    assert llm.multimodal_pool_bytes == 0
    assert llm.driver_gpu_id == 3
    engine.close()


def test_engine_is_configured_from_the_backend_config(model_dir: Path) -> None:
    engine = start(model_dir, max_num_seqs=7, gpu_memory_utilization=0.5, chunked_prefill=True, seed=11)
    llm = engine.llm_engine
    assert engine.max_model_len == MAX_MODEL_LEN == llm.model_config.max_model_len, "never DeepInfer's 4096"
    assert llm.scheduler_config.max_num_seqs == 7
    assert llm.scheduler_config.chunked_prefill
    assert llm.cache_config.gpu_memory_utilization == 0.5
    assert llm.model_config.seed == 11
    assert llm.model_config.served_model_name == "deepinfer"
    assert not llm.log_stats
    assert engine.vocab_size == llm.model_config.get_vocab_size()
    assert engine.tokenizer is llm.tokenizer.backend_tokenizer
    assert engine.fingerprint == "fp_deepinfer-0.1.0+testdouble-batch_invariant_off"
    engine.close()


def test_batch_invariance_is_named_in_the_fingerprint(model_dir: Path) -> None:
    engine = start(model_dir, env={"DEEPINFER_BATCH_INVARIANT": "1"})
    assert engine.fingerprint.endswith("batch_invariant_on")
    engine.close()


def test_request_aborted_while_compiling_its_grammar_never_runs(model_dir: Path) -> None:
    engine = start(model_dir)
    so_args = {"schema_type": "json", "schema": '{"type": "object"}'}
    add(engine, "g", ids(engine), so_args=so_args, max_tokens=100, ignore_eos=True)
    engine.abort_request(["g"])
    assert engine.llm_engine.scheduler.get_num_aborted_seqs() == 0, "the engine could not see it"
    outputs = run(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("g", "abort")], "aborted again once it surfaced"
    assert engine.get_num_unfinished_requests() == 0
    engine.close()


def test_grammar_request_that_was_not_aborted_runs_normally(model_dir: Path) -> None:
    engine = start(model_dir)
    so_args = {"schema_type": "regex", "schema": "[a-z]+"}
    add(engine, "g", ids(engine), so_args=so_args)
    outputs = run(engine)
    assert outputs[-1].finish_reason == "stop"
    assert not engine._compiling and not engine._reabort
    engine.close()


def test_grammar_compiler_without_cpus_fails_the_request_not_the_engine(model_dir: Path) -> None:
    os.environ["DEEPINFER_DOUBLE_IDLE_CPUS"] = "1"
    engine = start(model_dir)
    with pytest.raises(UpstreamError, match="structured outputs are unavailable"):
        add(engine, "g", ids(engine), so_args={"schema_type": "json", "schema": "{}"})
    add(engine, "plain", ids(engine))
    assert run(engine)[-1].finish_reason == "stop"
    engine.close()


def test_synthetic_final_outputs_carry_their_reason(model_dir: Path) -> None:
    engine = start(model_dir)
    too_long = np.full(MAX_MODEL_LEN + 1, 5, dtype=np.int32)
    too_long[-1] = 7
    add(engine, "long", too_long)
    (output,) = run(engine)
    assert (output.finish_reason, output.token_id, output.token_logprob) == ("prompt_length_exceeded", 7, 1.0)
    engine.close()


def test_kv_pressure_preempts_with_insufficient_system_resource_and_counts_it(model_dir: Path) -> None:
    engine = start(model_dir, gpu_memory_utilization=0.0004)  # 40 blocks of 16 tokens
    prompt = ids(engine)
    for i in range(4):
        add(engine, f"r{i}", prompt, max_tokens=200, ignore_eos=True)
    outputs = run(engine)
    finals = {o.request_id: o for o in outputs if o.finished}
    reasons = sorted(o.finish_reason for o in finals.values())
    assert "insufficient_system_resource" in reasons and "length" in reasons
    assert engine.statistics.preempted == reasons.count("insufficient_system_resource")
    engine.close()


def test_speculative_decoding_acceptance_is_counted_once_per_request_step(model_dir: Path) -> None:
    engine = start(model_dir, env={"DEEPINFER_USE_NEXTN_DECODE": "3"})
    add(engine, "a", ids(engine), max_tokens=40, ignore_eos=True)
    outputs = run(engine)
    decode_outputs = outputs[1:]  # the first token comes from the prefill, without drafts
    assert engine.drafts > 0
    assert engine.draft_tokens == 3 * engine.drafts
    assert engine.accepted_tokens == len(decode_outputs) - engine.drafts, "each step adds accepted drafts + 1"
    names = {s.name for s in engine.metric_samples()}
    assert {"engine_spec_decode_draft_tokens", "engine_spec_decode_accepted_tokens"} <= names
    engine.close()


def test_speculative_metrics_are_absent_when_drafting_is_off(model_dir: Path) -> None:
    engine = start(model_dir, env={"DEEPINFER_USE_NEXTN_DECODE": "0"})
    add(engine, "a", ids(engine))
    run(engine)
    assert engine.drafts == 0
    assert not any(s.name.startswith("engine_spec_decode") for s in engine.metric_samples())
    engine.close()


def test_cached_tokens_are_the_sequences_own_count_before_its_prefill(model_dir: Path) -> None:
    """DeepInfer 0.1.0 computes every new sequence's prompt (nothing is cached when it is added): no hits, though its
    ``num_cached_tokens`` reads the whole prompt once prefilled (reading it then would invent hits)."""
    engine = start(model_dir)
    prompt = ids(engine, "alpha beta gamma delta epsilon zeta eta theta")
    sequences = [add(engine, name, prompt, max_tokens=3) for name in ("first", "again")]
    outputs = run(engine)
    assert all(int(s.num_cached_tokens) >= len(prompt) for s in sequences)  # type: ignore[attr-defined]
    assert [o.num_cached_tokens for o in outputs] == [0] * len(outputs)
    samples = {s.name: s.value for s in engine.metric_samples()}
    assert samples["engine_prefix_cache_queried_tokens"] == 2 * len(prompt)
    assert samples["engine_prefix_cache_hit_tokens"] == 0
    engine.close()


def test_a_sequence_added_with_a_computed_prefix_reports_it_on_its_first_output(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence that starts with computed KV (as a scheduler fork does) reports it once, as the engine counted it."""
    from deepinfer.engine import llm_engine

    engine = start(model_dir)
    original = llm_engine.LLMEngine.add_request

    def add_forked(self: Any, *args: Any, **kwargs: Any) -> Any:
        sequence = original(self, *args, **kwargs)
        sequence.num_cached_tokens = 32  # what fork_seq leaves in cache.num_tokens
        return sequence

    monkeypatch.setattr(llm_engine.LLMEngine, "add_request", add_forked)
    add(engine, "forked", ids(engine, "alpha " * 40), max_tokens=3)
    outputs = run(engine)
    assert [o.num_cached_tokens for o in outputs] == [32, 0, 0]
    assert {s.name: s.value for s in engine.metric_samples()}["engine_prefix_cache_hit_tokens"] == 32
    engine.close()


# ---- start-up failures -------------------------------------------------------------------------------------------


def test_missing_package_is_a_clear_startup_error(model_dir: Path) -> None:
    sys.modules["deepinfer"] = None  # type: ignore[assignment]  # makes `import deepinfer` fail
    with pytest.raises(DeepInferStartupError, match=r"deepinfer package cannot be imported.*deepinfer-gateway\["):
        start(model_dir)


@pytest.mark.parametrize(
    ("device", "message"),
    [("sm90", "not SM100 \\(Hopper and older are refused"), ("none", "no GPU or NPU")],
)
def test_unsupported_hardware_is_refused_before_loading(model_dir: Path, device: str, message: str) -> None:
    os.environ["DEEPINFER_DOUBLE_DEVICE"] = device
    with pytest.raises(DeepInferStartupError, match=message):
        start(model_dir)
    from deepinfer.engine.llm_engine import LLMEngine

    assert LLMEngine.constructions == 0, "refused before construction (DeepInfer checks only after loading)"


def test_ascend_backend_sets_both_device_variables(model_dir: Path) -> None:
    os.environ["DEEPINFER_DOUBLE_DEVICE"] = "ascend950"
    engine = start(model_dir, accelerator="ascend", visible_devices="1,2", context_parallel_size=2, env={})
    import deepinfer

    assert deepinfer.IMPORT_ENVIRON["ASCEND_RT_VISIBLE_DEVICES"] == deepinfer.IMPORT_ENVIRON["CUDA_VISIBLE_DEVICES"]
    assert os.environ["DEEPINFER_ACCELERATOR"] == "ascend"
    engine.close()


def test_construction_error_names_the_cause(model_dir: Path) -> None:
    with pytest.raises(DeepInferStartupError, match=r"failed to start: .*KV cache"):
        start(model_dir, gpu_memory_utilization=0.0001)


def test_one_engine_per_process(model_dir: Path) -> None:
    first = start(model_dir)
    with pytest.raises(DeepInferStartupError, match="one engine per process"):
        start(model_dir, name="second")
    first.close()
    start(model_dir, name="second").close()  # the process is free again once the first engine closed


def test_missing_model_directory_is_reported_before_import(tmp_path: Path) -> None:
    with pytest.raises(DeepInferStartupError, match="does not exist"):
        start(tmp_path / "nowhere")
    with pytest.raises(DeepInferStartupError, match=r"lacks config\.json"):
        start(tmp_path)
    assert "deepinfer" not in sys.modules

"""Start-up on DeepInfer's real package: its ``_C`` is a torch C++ extension without an rpath to torch."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from backends.deepinfer.startup import DeepInferStartupError

from .conftest import Background, background_job, fresh_process_facts, launch_script, start


@background_job("c-before-torch")
def _c_before_torch(model_dir: Path) -> list[subprocess.Popen[str]]:
    return [launch_script("import deepinfer\nfrom deepinfer._C.engine import RequestOutput\n")]


@pytest.mark.background("c-before-torch")
@pytest.mark.background("fresh-process")
def test_deepinfer_c_loads_only_after_torch(background: Background) -> None:
    """The trap the binding must avoid: DeepInfer's ``__init__`` never imports torch, so ``_C`` right after it fails
    to load ``libc10.so``; DeepInfer's own modules always import torch first."""
    with pytest.raises(AssertionError, match=r"libc10\.so: cannot open shared object file"):
        background.output("c-before-torch")
    # The same import with torch loaded first (the binding imports deepinfer, then torch, then _C) works.
    assert fresh_process_facts(background)["imported"][1] == "deepinfer._C.engine"


@pytest.mark.background("fresh-process")
def test_the_binding_imports_deepinfer_in_a_fresh_process(background: Background) -> None:
    facts = fresh_process_facts(background)
    assert facts["imported_before"] == [], "nothing had imported torch or deepinfer before the binding"
    assert facts["imported"] == ["0.1.0", "deepinfer._C.engine"]


def test_engine_starts_from_the_backend_config(real_model_dir: Path) -> None:
    engine = start(real_model_dir, max_num_seqs=7, seed=11)
    llm = engine.llm_engine
    assert type(llm).__module__ == "deepinfer.engine.llm_engine"
    assert engine.max_model_len == llm.model_config.max_model_len == 256, "never DeepInfer's default 4096"
    assert llm.scheduler_config.max_num_seqs == 7
    assert llm.model_config.seed == 11
    assert not llm.log_stats
    assert engine.vocab_size == llm.model_config.get_vocab_size()
    assert engine.tokenizer is llm.tokenizer.backend_tokenizer
    assert engine.tokenizer.encode("alpha").ids[0] == 0, "DeepInfer's tokenizer prepends BOS"
    assert engine.fingerprint == "fp_deepinfer-0.1.0-batch_invariant_off"
    engine.close()


def test_construction_failure_is_a_startup_error(real_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    config["tokenizer_compatibility"] = "legacy"  # DeepInfer's tokenizer loader refuses it
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((real_model_dir / name).read_text())
    with pytest.raises(DeepInferStartupError, match=r"DeepInfer failed to start.*tokenizer_compatibility"):
        start(tmp_path)


@pytest.mark.background("fresh-process")
def test_deepinfer_cannot_build_a_second_engine_in_a_process(background: Background) -> None:
    """DeepInfer caches its process groups for the life of the process, so after ``close()`` a new engine gets the
    destroyed ones and fails to start: restarting an engine means a new process. (The harness clears that cache for
    the other tests, which build many engines in one process.)"""
    second = fresh_process_facts(background)["second_engine"]
    assert second.startswith("refused:") and "is not registered" in second

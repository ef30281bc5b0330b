"""The binding's tests on DeepInfer's REAL engine: run only inside the harness (Python 3.12, see ``../harness``).

The main suite runs this directory in a subprocess (``../test_real_engine.py``) with the harness interpreter and
``PYTHONPATH`` = ``src``, the harness runtime (DeepInfer's model replaced by a stub) and the built DeepInfer package.
Engines are built with the binding's own ``start_engine``, one at a time; ``os.environ`` is restored after each test,
since the binding sets engine variables process-wide.

Variables DeepInfer reads once per process (``DEEPINFER_PREFILL_ATTEMPT_INTERVAL`` when ``deepinfer.config`` is
imported, ``DEEPINFER_USE_NEXTN_DECODE`` on first use) are the same for every in-process engine: ``ENGINE_ENV``,
which every test passes in its config's ``env``, as deploy/config/deepinfer.yaml does. Tests of other values run
their own process (``run_script``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.config import DeepInferBackendConfig
from backends.deepinfer import startup
from backends.deepinfer.engine import DeepInferEngine
from backends.deepinfer.startup import start_engine
from backends.engine.protocol import EngineOutput

from ..conftest import MAX_MODEL_LEN

ENGINE_ENV = {"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1", "DEEPINFER_USE_NEXTN_DECODE": "0"}
"""Prefill at the next step (the documented setting), and one token per request per step (the stub has no MTP)."""

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"


def pytest_configure(config: pytest.Config) -> None:
    if sys.version_info < (3, 12) or os.environ.get("DEEPINFER_HARNESS") != "1":
        raise pytest.UsageError("tests/backends/deepinfer/real run only in the DeepInfer harness (test_real_engine.py)")


@pytest.fixture(scope="session")
def real_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The double's model directory, loaded by DeepInfer's own tokenizer loader in its ``native`` mode.

    Its ``release`` mode also requires the 21 multimodal placeholders at ids 129280-129300, i.e. DeepSeek's full
    vocabulary; the test tokenizer is small. ``native`` loads the class ``tokenizer_config.json`` names:
    ``LlamaTokenizerFast`` with ``add_bos_token``, as ``release`` does.
    """
    directory = tmp_path_factory.mktemp("deepinfer-real-model")
    (directory / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    config["tokenizer_compatibility"] = "native"
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "legacy": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    startup._release_process()


def real_config(model_dir: Path, **overrides: Any) -> DeepInferBackendConfig:
    env = {**ENGINE_ENV, **overrides.pop("env", {})}
    fields: dict[str, Any] = {
        "name": "deepinfer",
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        "env": env,
    }
    fields.update(overrides)
    return DeepInferBackendConfig(**fields)


def start(model_dir: Path, **overrides: Any) -> DeepInferEngine:
    return start_engine(real_config(model_dir, **overrides))


def forwards(engine: DeepInferEngine) -> list[tuple[bool, list[str]]]:
    """Every forward the stub model ran: (is_prompt, request ids), placeholder steps included."""
    return engine.llm_engine.driver_worker.model_runner.forwards


def outputs_of(outputs: list[EngineOutput]) -> list[tuple[str, int, bool, str]]:
    return [(o.request_id, o.token_id, o.finished, o.finish_reason) for o in outputs]


REPO = Path(__file__).resolve().parents[4]


def run_script(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Runs ``script`` in a fresh harness interpreter (same ``PYTHONPATH``) and returns its stdout; fails with its
    output if it exits non-zero."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # its own rendezvous
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env={**inherited, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"script failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout

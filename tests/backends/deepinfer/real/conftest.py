"""The binding's tests on DeepInfer's REAL engine: run only inside the harness (Python 3.12, see ``../harness``).

The main suite runs this directory in a subprocess (``../test_real_engine.py``) with the harness interpreter and
``PYTHONPATH`` = ``src``, the harness runtime (DeepInfer's model replaced by a stub) and the built DeepInfer package.
Engines are built with the binding's own ``start_engine``, one at a time; ``os.environ`` is restored after each test,
since the binding sets engine variables process-wide.

Variables DeepInfer reads once per process (``DEEPINFER_PREFILL_ATTEMPT_INTERVAL`` when ``deepinfer.config`` is
imported, ``DEEPINFER_USE_NEXTN_DECODE`` on first use) are the same for every in-process engine: ``ENGINE_ENV``,
which every test passes in its config's ``env``, as deploy/config/deepinfer.yaml does. Tests of other values, and
of a fresh process, run their own processes. Those are independent and each spends seconds importing torch, so
they are *background jobs*: a test names its job with ``@pytest.mark.background(name)`` (registered with
``background_job``), every job the collected tests name starts when the session starts, side by side with the
in-process tests, and the test reads its result from the ``background`` fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
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
    config.addinivalue_line("markers", "background(name): the test reads the result of that background job")


Job = Callable[[Path], list[subprocess.Popen[str]]]
JOBS: dict[str, Job] = {}
"""Background jobs by name: each starts its processes (given ``real_model_dir``) and returns them."""


def background_job(name: str) -> Callable[[Job], Job]:
    def register(job: Job) -> Job:
        assert name not in JOBS, f"two background jobs named {name!r}"
        JOBS[name] = job
        return job

    return register


class Background:
    """The session's background jobs: started together, each awaited by the test that reads it."""

    def __init__(self, model_dir: Path, names: set[str]) -> None:
        self._processes = {name: JOBS[name](model_dir) for name in sorted(names)}
        self._outputs: dict[str, str | AssertionError] = {}

    def processes(self, name: str) -> list[subprocess.Popen[str]]:
        """The job's processes (started at session start); a test waits for them itself."""
        if name not in self._processes:
            raise AssertionError(f"background job {name!r} was not started: mark the test with background({name!r})")
        return self._processes[name]

    def output(self, name: str, timeout: float = 180) -> str:
        """The stdout of a one-process job (several tests may read it); fails with its output if it exited
        non-zero."""
        if name not in self._outputs:
            (process,) = self.processes(name)
            try:
                self._outputs[name] = script_output(process, timeout)
            except AssertionError as failure:
                self._outputs[name] = failure
        result = self._outputs[name]
        if isinstance(result, AssertionError):
            raise AssertionError(*result.args)
        return result

    def stop(self) -> None:
        for processes in self._processes.values():
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.communicate()


@pytest.fixture(scope="session", autouse=True)
def background(request: pytest.FixtureRequest, real_model_dir: Path) -> Iterator[Background]:
    names = {marker.args[0] for item in request.session.items for marker in item.iter_markers("background")}
    jobs = Background(real_model_dir, names)
    yield jobs
    jobs.stop()


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


def launch_script(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Starts ``script`` in a fresh harness interpreter (same ``PYTHONPATH``, its own rendezvous)."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env={**inherited, **(env or {})},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def script_output(process: subprocess.Popen[str], timeout: float = 120) -> str:
    """The stdout of a launched script; fails with its output if it exits non-zero."""
    stdout, stderr = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise AssertionError(f"script failed ({process.returncode}):\n{stdout}\n{stderr}")
    return stdout


FRESH_TIMELINE = "one-rank-default-intervals"
"""The ``../admission.py`` timeline the fresh process plays: DeepInfer's default prefill intervals."""

_FRESH_PROCESS = """
    import json, sys
    from backends.config import DeepInferBackendConfig
    from backends.deepinfer.startup import DeepInferStartupError, import_deepinfer, start_engine
    from tests.backends.deepinfer.admission import BY_NAME, play

    model, timeline = sys.argv[1], BY_NAME[sys.argv[2]]
    facts = {"imported_before": sorted({"torch", "deepinfer"} & set(sys.modules))}
    modules = import_deepinfer()
    facts["imported"] = [modules.version, modules.RequestOutput.__module__]
    facts["timeline"] = play(timeline, model)  # builds an engine with the binding, and closes it
    config = DeepInferBackendConfig(name="d", model=model, max_model_len=256, max_num_seqs=8, env=timeline.env)
    try:
        start_engine(config)
        facts["second_engine"] = "started"
    except DeepInferStartupError as exc:
        facts["second_engine"] = f"refused: {exc}"
    print(json.dumps(facts))
    """


@background_job("fresh-process")
def _fresh_process(model_dir: Path) -> list[subprocess.Popen[str]]:
    """One fresh harness process for what needs one (DeepInfer's own process-wide state, as shipped: its process
    group cache kept): the binding's first import, an engine with DeepInfer's default prefill intervals, then a
    second engine after the first closed. Its facts, one JSON object, are read by several tests."""
    env = {"DEEPINFER_HARNESS_KEEP_GROUP_CACHE": "1"}
    return [launch_script(_FRESH_PROCESS, str(model_dir), FRESH_TIMELINE, env=env)]


def fresh_process_facts(background: Background) -> dict[str, Any]:
    return json.loads(background.output("fresh-process").strip().splitlines()[-1])

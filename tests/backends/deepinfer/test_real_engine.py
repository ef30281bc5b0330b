"""Runs ``real/`` (the binding's tests on DeepInfer's real engine) in the harness, and reports each of its tests.

DeepInfer needs Python 3.12 and the gateway runs on 3.11+, so ``real/`` runs as one pytest session under the
harness interpreter (built once per machine by ``harness/build.py``; the first run builds it, about 15 minutes on
a fresh machine), with ``PYTHONPATH`` = ``src``, the harness runtime and the built DeepInfer package. Each test
there appears here under its own name, passing or failing with that session's report.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from .harness.build import built_harness, ensure_harness

HERE = Path(__file__).resolve().parent
REAL = HERE / "real"
REPO = HERE.parents[2]
RUNTIME = HERE / "harness" / "runtime"
BUILD_TIMEOUT = 3600
SESSION_TIMEOUT = 600


def _real_tests() -> list[str]:
    """``module::test`` for every test function in ``real/`` (parameters are matched by prefix)."""
    names = []
    for module in sorted(REAL.glob("test_*.py")):
        tree = ast.parse(module.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
                names.append(f"{module.stem}::{node.name}")
    return names


@pytest.fixture(scope="module")
def session_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str]]]:
    harness = ensure_harness()
    report = tmp_path_factory.mktemp("deepinfer-real") / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(RUNTIME), str(harness.pkg)]),
        "DEEPINFER_HARNESS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    command = [str(harness.python), "-m", "pytest", str(REAL), "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=SESSION_TIMEOUT, check=False
    )
    sys.stderr.write(result.stdout[-20000:] + result.stderr[-5000:])
    if not report.exists():
        pytest.fail(f"the harness session did not run ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[")[0]
        failure = next((child for child in case if child.tag in ("failure", "error")), None)
        skipped = next((child for child in case if child.tag == "skipped"), None)
        verdict = "failed" if failure is not None else "skipped" if skipped is not None else "passed"
        detail = (failure.get("message", "") + "\n" + (failure.text or "")) if failure is not None else ""
        outcomes.setdefault(f"{module}::{name}", []).append((verdict, detail))
    return outcomes


def _timeout() -> int:
    return SESSION_TIMEOUT + (0 if built_harness() is not None else BUILD_TIMEOUT)


@pytest.mark.timeout(_timeout())
@pytest.mark.parametrize("test", _real_tests())
def test_on_the_real_engine(session_report: dict[str, list[tuple[str, str]]], test: str) -> None:
    outcomes = session_report.get(test)
    assert outcomes, f"{test} did not run in the harness session"
    failures = [detail for verdict, detail in outcomes if verdict != "passed"]
    assert not failures, "\n\n".join(failures)

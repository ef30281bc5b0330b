"""The load generator stays out of the server: not imported by it, not in the image, loaded lazily by ``bench``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER_MODULES = ("gateway.app", "gateway.server", "gateway.cli")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_server_never_imports_the_load_generator() -> None:
    imports = "; ".join(f"import {module}" for module in SERVER_MODULES)
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'loadgen'))"
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the server imported {result.stdout.strip()}"


def test_the_docker_build_context_leaves_the_load_generator_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "src/loadgen" in ignored
    assert (ROOT / "src" / "loadgen" / "__init__.py").is_file()  # what the line names exists


def test_bench_without_the_load_generator_says_so() -> None:
    code = (
        "import sys; sys.modules['loadgen'] = None; sys.argv = ['deepinfer-gateway', 'bench', '--url', 'http://x', "
        "'--model', 'm', '--out', 'o']; from gateway.cli import main; main()"
    )
    result = _run(code)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "bench needs the loadgen package" in result.stderr

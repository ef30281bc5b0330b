"""xgrammar at the version DeepInfer 0.1.0 pins, for the harness interpreter: the grammar engine of its ``so_args``.

xgrammar's wheel needs torch, transformers and triton, which the harness virtualenv already has (its CPU-capable
torch 2.13.0 among them), so this third layer holds only xgrammar and its one other dependency, installed with
``--no-deps`` into ``deepinfer-harness-xgrammar-<key>`` (about 60 MB) and put on ``PYTHONPATH`` beside DeepInfer's
package. Kept apart from ``build.py`` so that neither the virtualenv nor the compiled core is rebuilt for it; built
once per machine like them (under the same file lock scheme), in seconds.

Run ``python tests/backends/deepinfer/harness/xgrammar.py`` to build (or find) it and print its path.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    from .build import Harness, _build_layer, _digest, _run, cache_dir, ensure_harness, venv_key
except ImportError:  # run as a script
    from build import Harness, _build_layer, _digest, _run, cache_dir, ensure_harness, venv_key  # type: ignore[no-redef]

XGRAMMAR_PINS = ("xgrammar==0.2.2", "apache-tvm-ffi==0.1.15.post2")
"""DeepInfer 0.1.0's ``requirements.txt`` pins xgrammar 0.2.2; apache-tvm-ffi is its only dependency the harness
virtualenv lacks (its others, torch, transformers, triton, pydantic, numpy, are there)."""

XGRAMMAR_CHECK = "import xgrammar\nprint(xgrammar.__file__)\n"


def xgrammar_key() -> str:
    return _digest(venv_key().encode(), repr((XGRAMMAR_PINS, XGRAMMAR_CHECK)).encode(), Path(__file__).read_bytes())


def xgrammar_path() -> Path:
    return cache_dir() / f"deepinfer-harness-xgrammar-{xgrammar_key()}"


def ensure_xgrammar(harness: Harness | None = None, *, quiet: bool = False) -> Path:
    """The directory to add to the harness interpreter's ``PYTHONPATH`` for xgrammar (built if missing)."""
    harness = harness or ensure_harness(quiet=quiet)

    def build(partial: Path, log: Path) -> None:
        pip = [str(harness.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        _run([*pip, "--no-deps", "--only-binary=:all:", "--target", str(partial), *XGRAMMAR_PINS], log)
        _run([str(harness.python), "-c", XGRAMMAR_CHECK], log, env={**os.environ, "PYTHONPATH": str(partial)})

    return _build_layer(xgrammar_path(), build, quiet=quiet)


if __name__ == "__main__":
    print(ensure_xgrammar())

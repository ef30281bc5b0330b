"""The harness virtualenv: LMDeploy 0.18.0's HTTP layer on CPU torch, kept out of the gateway's own environment.

Built once per machine and reused: ``$DEEPINFER_GATEWAY_CACHE/lmdeploy-harness-<key>`` (default cache
``~/.cache/deepinfer-gateway``), where the key hashes ``requirements.txt``, the install steps below and the Python
version. Building happens under a file lock in a ``.partial-<pid>`` directory that is renamed into place only after
the install finished and imports were checked, so a crash mid-install never leaves a broken cache.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from ....cached_build import build_once, cache_dir, run_logged

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
TORCH = "torch==2.13.0"  # the CPU wheel this machine keeps on disk; pinned so pip never picks a CUDA build
LMDEPLOY = "lmdeploy==0.18.0"
NO_DEPS = ("xgrammar==0.2.9", "apache-tvm-ffi==0.1.15.post2")  # response_format; xgrammar's deps pull triton
STEPS = (
    (TORCH,),
    ("--no-deps", LMDEPLOY),
    ("-r", str(REQUIREMENTS)),
    ("--no-deps", *NO_DEPS),
)
CHECK = (
    "import torch, lmdeploy, xgrammar\n"
    "import lmdeploy.cli.entrypoint, lmdeploy.serve.core.async_engine\n"
    "assert torch.version.cuda is None, 'a CUDA build of torch was installed: ' + torch.__version__\n"
    "print(torch.__version__, lmdeploy.__version__)\n"
)


def venv_key() -> str:
    digest = hashlib.sha256()
    digest.update(REQUIREMENTS.read_bytes())
    steps = [[part if part != str(REQUIREMENTS) else REQUIREMENTS.name for part in step] for step in STEPS]
    digest.update(repr((steps, CHECK, sys.version_info[:2])).encode())  # no absolute paths: one cache per machine
    return digest.hexdigest()[:16]


def venv_path() -> Path:
    return cache_dir() / f"lmdeploy-harness-{venv_key()}"


def harness_python() -> Path | None:
    """The cached harness interpreter, or None when the virtualenv is not built yet."""
    path = venv_path()
    return path / "bin" / "python" if (path / ".complete").exists() else None


def ensure_harness_venv(*, quiet: bool = False) -> Path:
    """Returns the harness interpreter, building the virtualenv first if this machine has none (a few minutes)."""
    target = venv_path()

    def build(partial: Path, log: Path) -> str:
        started = time.monotonic()
        if not quiet:
            print(f"building the LMDeploy harness virtualenv in {target} (log: {log})", file=sys.stderr)
        what = "the LMDeploy harness virtualenv"
        run_logged([sys.executable, "-m", "venv", str(partial)], log, what=what)
        python = str(partial / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--only-binary=:all:"]
        for step in STEPS:
            run_logged([*pip, *step], log, what=what)
        run_logged([python, "-c", CHECK], log, what=what)
        seconds = round(time.monotonic() - started, 1)
        if not quiet:
            print(f"LMDeploy harness virtualenv built in {seconds} s", file=sys.stderr)
        return json.dumps({"key": venv_key(), "build_seconds": seconds})

    build_once(target, build)
    ready = harness_python()
    assert ready is not None
    return ready


if __name__ == "__main__":
    print(ensure_harness_venv())

"""The harness virtualenv: LMDeploy 0.18.0's HTTP layer on CPU torch, kept out of the gateway's own environment.

Built once per machine and reused: ``$DEEPINFER_GATEWAY_CACHE/lmdeploy-harness-<key>`` (default cache
``~/.cache/deepinfer-gateway``), where the key hashes ``requirements.txt``, the install steps below and the Python
version. Building happens under a file lock in a ``.partial-<pid>`` directory that is renamed into place only after
the install finished and imports were checked, so a crash mid-install never leaves a broken cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_GATEWAY_CACHE", "~/.cache/deepinfer-gateway")).expanduser()


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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"building the LMDeploy harness virtualenv failed: {' '.join(command)}\n{tail}")


def ensure_harness_venv(*, quiet: bool = False) -> Path:
    """Returns the harness interpreter, building the virtualenv first if this machine has none (a few minutes)."""
    ready = harness_python()
    if ready is not None:
        return ready
    target = venv_path()
    with _locked(target.with_name(target.name + ".lock")):
        ready = harness_python()
        if ready is not None:  # another process built it while we waited for the lock
            return ready
        for stale in target.parent.glob(target.name + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died: we hold the lock now
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        log = target.with_name(target.name + ".log")
        log.write_text("")
        started = time.monotonic()
        if not quiet:
            print(f"building the LMDeploy harness virtualenv in {target} (log: {log})", file=sys.stderr)
        _run([sys.executable, "-m", "venv", str(partial)], log)
        python = str(partial / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--only-binary=:all:"]
        for step in STEPS:
            _run([*pip, *step], log)
        _run([python, "-c", CHECK], log)
        seconds = round(time.monotonic() - started, 1)
        (partial / ".complete").write_text(json.dumps({"key": venv_key(), "build_seconds": seconds}))
        if target.exists():
            shutil.rmtree(target)
        os.rename(partial, target)
        if not quiet:
            print(f"LMDeploy harness virtualenv built in {seconds} s", file=sys.stderr)
    ready = harness_python()
    assert ready is not None
    return ready


if __name__ == "__main__":
    print(ensure_harness_venv())

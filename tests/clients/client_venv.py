"""Virtualenvs for client libraries whose pins cannot share the dev environment, built once per machine.

instructor 1.17 pins ``jiter<0.15`` while the openai SDK the suite uses (3.57) needs ``jiter>=0.16``, so installing
it beside the dev extra would downgrade the SDK for every other test. Such a client gets its own virtualenv under
``$DEEPINFER_GATEWAY_CACHE/client-<name>-<key>`` (default cache ``~/.cache/deepinfer-gateway``); the key hashes the
requirements and the Python version. It is built under a file lock in a ``.partial-<pid>`` directory that is
renamed into place only after the install finished and the imports worked, so a crash never leaves a broken cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_GATEWAY_CACHE", "~/.cache/deepinfer-gateway")).expanduser()


def venv_path(name: str, requirements: tuple[str, ...]) -> Path:
    key = hashlib.sha256(repr((requirements, sys.version_info[:2])).encode()).hexdigest()[:16]
    return cache_dir() / f"client-{name}-{key}"


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
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"building a client virtualenv failed: {' '.join(command)}\n{tail}")


def client_python(name: str, requirements: tuple[str, ...], check: str) -> Path:
    """The interpreter of the client's virtualenv, building it first if this machine has none (about a minute)."""
    target = venv_path(name, requirements)
    python = target / "bin" / "python"
    if (target / ".complete").exists():
        return python
    with _locked(target.with_name(target.name + ".lock")):
        if (target / ".complete").exists():  # another process built it while we waited for the lock
            return python
        for stale in target.parent.glob(target.name + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died: we hold the lock now
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        log = target.with_name(target.name + ".log")
        log.write_text("")
        _run([sys.executable, "-m", "venv", str(partial)], log)
        pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        _run([*pip, "--only-binary=:all:", *requirements], log)
        _run([str(partial / "bin" / "python"), "-c", check], log)
        (partial / ".complete").write_text(" ".join(requirements))
        if target.exists():
            shutil.rmtree(target)
        os.rename(partial, target)
    return python


if __name__ == "__main__":
    from .test_instructor import CHECK, REQUIREMENTS

    print(client_python("instructor", REQUIREMENTS, CHECK))

"""Environments the tests build once per machine under the shared cache (``$DEEPINFER_GATEWAY_CACHE``, default
``~/.cache/deepinfer-gateway``): one builder at a time under a file lock, in a ``.partial-<pid>`` directory that is
renamed into place only once complete, so a crash mid-build never leaves a broken cache."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_GATEWAY_CACHE", "~/.cache/deepinfer-gateway")).expanduser()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_logged(command: list[str], log: Path, *, what: str) -> None:
    """Runs one build step with its output appended to ``log``; a failure names the step and shows the log's tail."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"building {what} failed: {' '.join(command)}\n{tail}")


def build_once(target: Path, build: Callable[[Path, Path], str]) -> None:
    """Builds ``target`` unless it is complete: ``build(partial, log)`` fills the partial directory and returns the
    text of its ``.complete`` marker."""
    if (target / ".complete").exists():
        return
    with locked(target.with_name(target.name + ".lock")):
        if (target / ".complete").exists():  # another process built it while we waited for the lock
            return
        for stale in target.parent.glob(target.name + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died: we hold the lock now
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        log = target.with_name(target.name + ".log")
        log.write_text("")
        marker = build(partial, log)
        (partial / ".complete").write_text(marker)
        if target.exists():
            shutil.rmtree(target)
        os.rename(partial, target)

"""Virtualenvs for client libraries whose pins cannot share the dev environment, built once per machine.

instructor 1.17 pins ``jiter<0.15`` while the openai SDK the suite uses (3.57) needs ``jiter>=0.16``, so installing
it beside the dev extra would downgrade the SDK for every other test. Such a client gets its own virtualenv under
``$DEEPINFER_GATEWAY_CACHE/client-<name>-<key>`` (default cache ``~/.cache/deepinfer-gateway``); the key hashes the
requirements and the Python version. It is built under a file lock in a ``.partial-<pid>`` directory that is
renamed into place only after the install finished and the imports worked, so a crash never leaves a broken cache.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from ..cached_build import build_once, cache_dir, run_logged


def venv_path(name: str, requirements: tuple[str, ...]) -> Path:
    key = hashlib.sha256(repr((requirements, sys.version_info[:2])).encode()).hexdigest()[:16]
    return cache_dir() / f"client-{name}-{key}"


def client_python(name: str, requirements: tuple[str, ...], check: str) -> Path:
    """The interpreter of the client's virtualenv, building it first if this machine has none (about a minute)."""
    target = venv_path(name, requirements)

    def build(partial: Path, log: Path) -> str:
        what = f"the {name} client virtualenv"
        run_logged([sys.executable, "-m", "venv", str(partial)], log, what=what)
        pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        run_logged([*pip, "--only-binary=:all:", *requirements], log, what=what)
        run_logged([str(partial / "bin" / "python"), "-c", check], log, what=what)
        return " ".join(requirements)

    build_once(target, build)
    return target / "bin" / "python"


if __name__ == "__main__":
    from .test_instructor import CHECK, REQUIREMENTS

    print(client_python("instructor", REQUIREMENTS, CHECK))

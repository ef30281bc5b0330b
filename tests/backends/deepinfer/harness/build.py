"""The DeepInfer harness: DeepInfer 0.1.0's real engine core, built for the CPU, in a Python 3.12 virtualenv.

DeepInfer needs Python 3.12 and ships only an sdist whose ``setup.py`` builds a CUDA extension. This module builds,
once per machine and cached under ``$DEEPINFER_GATEWAY_CACHE`` (default ``~/.cache/deepinfer-gateway``):

1. ``deepinfer-harness-venv-<key>``: a Python 3.12 virtualenv with torch 2.13.0 (PyPI's only cp312 wheel is the
   CUDA build; it imports and runs on a machine without a GPU), DeepInfer's pure-Python dependencies and what the
   binding's tests import (``requirements.txt``). About 5 GB.
2. ``deepinfer-harness-core-<key>``: DeepInfer 0.1.0's sdist from PyPI (checked against its sha256), its ``csrc``
   patched for the CPU (``core/patch.py``) and compiled as a torch ``CppExtension`` (``core/setup_core.py``) with two
   CPU stand-ins for its CUDA-only sources (``core/stubs``), and ``pkg/``: the sdist's own Python packages with the
   built ``deepinfer._C`` dropped in, importable with ``PYTHONPATH=<core>/pkg``.

Each layer is built under a file lock in a ``.partial-<pid>`` directory that is renamed into place only once the
build finished and its check passed, so a crash never leaves a broken cache. A layer's key hashes everything that
goes into it (for the core: this module, ``core/``, the venv key), never an absolute path.

Run ``python tests/backends/deepinfer/harness/build.py`` to build (or find) both layers and print the core path.
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
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORE_SOURCES = HERE / "core"
REQUIREMENTS = HERE / "requirements.txt"
PYTHON_VERSION = "3.12.1"
TORCH = "torch==2.13.0"
BUILD_TOOLS = ("setuptools>=70", "ninja", "numpy")
DEEPINFER = "deepinfer==0.1.0"
SDIST_NAME = "deepinfer-0.1.0.tar.gz"
SDIST_SHA256 = "959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a"
VENV_CHECK = "import torch, transformers, pydantic, pytest\nprint(torch.__version__)\n"
CORE_CHECK = (
    "import torch\n"
    "import deepinfer._C\n"
    "from deepinfer._C.engine import RequestOutput, Scheduler\n"
    "print(deepinfer._C.__file__)\n"
)


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_GATEWAY_CACHE", "~/.cache/deepinfer-gateway")).expanduser()


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def venv_key() -> str:
    return _digest(REQUIREMENTS.read_bytes(), repr((PYTHON_VERSION, TORCH, BUILD_TOOLS, VENV_CHECK)).encode())


def core_key() -> str:
    sources = sorted(path for path in CORE_SOURCES.rglob("*") if path.is_file() and "__pycache__" not in path.parts)
    parts = [str(path.relative_to(CORE_SOURCES)).encode() + b"\0" + path.read_bytes() for path in sources]
    return _digest(venv_key().encode(), Path(__file__).read_bytes(), *parts)


def venv_path() -> Path:
    return cache_dir() / f"deepinfer-harness-venv-{venv_key()}"


def core_path() -> Path:
    return cache_dir() / f"deepinfer-harness-core-{core_key()}"


@dataclass(frozen=True)
class Harness:
    """A built harness: the Python 3.12 interpreter and the directory to put on its ``PYTHONPATH``."""

    python: Path
    pkg: Path

    @property
    def build_seconds(self) -> float:
        venv = json.loads((self.python.parents[1] / ".complete").read_text())["build_seconds"]
        core = json.loads((self.pkg.parent / ".complete").read_text())["build_seconds"]
        return float(venv) + float(core)


def built_harness() -> Harness | None:
    """The cached harness, or None when either layer is not built yet."""
    venv, core = venv_path(), core_path()
    if (venv / ".complete").exists() and (core / ".complete").exists():
        return Harness(python=venv / "bin" / "python", pkg=core / "pkg")
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str], log: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"building the DeepInfer harness failed: {' '.join(command)}\n{tail}")


def _build_layer(target: Path, build: Callable[[Path, Path], None], *, quiet: bool) -> Path:
    """Builds ``target`` with ``build(partial, log)`` unless it is complete; one builder per machine at a time."""
    if (target / ".complete").exists():
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if (target / ".complete").exists():  # another process built it while we waited for the lock
            return target
        for stale in target.parent.glob(target.name + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died: we hold the lock now
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        log = target.with_name(target.name + ".log")
        log.write_text("")
        if not quiet:
            print(f"building {target.name} (log: {log})", file=sys.stderr)
        started = time.monotonic()
        build(partial, log)
        seconds = round(time.monotonic() - started, 1)
        (partial / ".complete").write_text(json.dumps({"build_seconds": seconds}))
        if target.exists():
            shutil.rmtree(target)
        os.rename(partial, target)
        if not quiet:
            print(f"built {target.name} in {seconds} s", file=sys.stderr)
    return target


def _base_python() -> list[str]:
    """The Python 3.12 to create the virtualenv with: ``$DEEPINFER_HARNESS_PYTHON``, else pyenv's 3.12."""
    explicit = os.environ.get("DEEPINFER_HARNESS_PYTHON")
    return [explicit] if explicit else ["python3.12"]


def _build_venv(partial: Path, log: Path) -> None:
    env = {**os.environ, "PYENV_VERSION": PYTHON_VERSION}
    _run([*_base_python(), "-m", "venv", str(partial)], log, env=env)
    python = str(partial / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    # torch first and alone: PyPI's cp312 wheel is the CUDA build, whose nvidia-* dependencies `import torch` needs.
    _run([*pip, "--only-binary=:all:", TORCH, *BUILD_TOOLS], log)
    _run([*pip, "--only-binary=:all:", "-r", str(REQUIREMENTS)], log)
    _run([python, "-c", VENV_CHECK], log)


def _download_sdist(python: Path, into: Path, log: Path) -> Path:
    # setup.py imports torch to describe itself, so pip must prepare it in this environment, not an isolated one;
    # CUDA_HOME is only read by torch's cpp_extension at import, never used.
    env = {**os.environ, "CUDA_HOME": "/usr/local/cuda", "VIRTUAL_ENV": str(python.parents[1])}
    into.mkdir(parents=True, exist_ok=True)
    command = [str(python), "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "--no-deps"]
    _run([*command, "--no-binary=:all:", "--no-build-isolation", DEEPINFER, "-d", str(into)], log, env=env)
    sdist = into / SDIST_NAME
    actual = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if actual != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_NAME} has sha256 {actual}, expected {SDIST_SHA256}")
    return sdist


def _build_core(python: Path) -> Callable[[Path, Path], None]:
    def build(partial: Path, log: Path) -> None:
        sdist = _download_sdist(python, partial / "download", log)
        with tarfile.open(sdist) as archive:
            archive.extractall(partial / "download", filter="data")
        source = partial / "download" / SDIST_NAME.removesuffix(".tar.gz")
        work = partial / "build"
        shutil.copytree(source / "csrc", work / "csrc")
        shutil.copytree(CORE_SOURCES / "stubs", work / "stubs")
        shutil.copy(CORE_SOURCES / "setup_core.py", work / "setup_core.py")
        (work / "deepinfer").mkdir()  # build_ext --inplace writes deepinfer/_C*.so here
        _run([str(python), str(CORE_SOURCES / "patch.py"), str(work / "csrc")], log)
        env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", "2")}
        _run([str(python), "setup_core.py", "build_ext", "--inplace"], log, cwd=work, env=env)
        pkg = partial / "pkg"
        for package in ("deepinfer", "deep_cluster"):
            shutil.copytree(source / package, pkg / package)
        (built,) = (work / "deepinfer").glob("_C.*.so")
        shutil.copy(built, pkg / "deepinfer" / built.name)
        shutil.rmtree(work / "build", ignore_errors=True)  # object files: the .so is all that is used
        _run([str(python), "-c", CORE_CHECK], log, env={**os.environ, "PYTHONPATH": str(pkg)})

    return build


def ensure_harness(*, quiet: bool = False) -> Harness:
    """The harness, building what this machine lacks first (about 5 minutes for each layer)."""
    venv = _build_layer(venv_path(), _build_venv, quiet=quiet)
    python = venv / "bin" / "python"
    core = _build_layer(core_path(), _build_core(python), quiet=quiet)
    return Harness(python=python, pkg=core / "pkg")


if __name__ == "__main__":
    harness = ensure_harness()
    print(harness.python)
    print(harness.pkg)

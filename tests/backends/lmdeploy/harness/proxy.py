"""Starts LMDeploy's real proxy (``lmdeploy serve proxy``) from the harness virtualenv, on loopback, and registers
harness api_server nodes with it through its own ``/nodes/*`` routes."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ....waiting import wait_ready
from .server import MODEL_NAME, HarnessNode, free_port
from .venv import ensure_harness_venv

HYBRID, PREFILL, DECODE = 1, 2, 3  # LMDeploy's EngineRole values, as /nodes/add takes them


@dataclass
class HarnessProxy:
    """One proxy process. Its status is never cached to disk (``--disable-cache-status``): the default file sits
    inside the installed lmdeploy package, which the harness virtualenv shares between test runs."""

    python: Path
    workdir: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"proxy-{self.port}.log"

    def start(self, *, ready_timeout: float = 90.0) -> HarnessProxy:
        command = [
            str(self.python),
            "-m",
            "lmdeploy",
            "serve",
            "proxy",
            "--server-name",
            "127.0.0.1",
            "--server-port",
            str(self.port),
            "--disable-cache-status",
            *self.args,
        ]
        env = {**os.environ, "UVICORN_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if wait_ready(f"{self.url}/nodes/status", timeout=ready_timeout, alive=self._alive):
            return self
        self.stop()
        raise RuntimeError(f"LMDeploy proxy not up after {ready_timeout} s:\n{self._log_tail()}")

    def add(self, node: HarnessNode | str, *, role: int = HYBRID, model: str = MODEL_NAME) -> None:
        """Registers ``node`` (or a url) as the api_server would with ``--proxy-url`` (models and role given)."""
        url = node if isinstance(node, str) else node.url
        body = {"url": url, "status": {"models": [model], "role": role}}
        answer = httpx.post(f"{self.url}/nodes/add", json=body, timeout=10)
        assert answer.status_code == 200 and "success" in answer.text.lower(), answer.text

    def remove(self, node: HarnessNode | str) -> None:
        url = node if isinstance(node, str) else node.url
        answer = httpx.post(f"{self.url}/nodes/remove", json={"url": url}, timeout=10)
        assert answer.status_code == 200 and "success" in answer.text.lower(), answer.text

    def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/nodes/status", timeout=10).json()
        return answer

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    def _alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"LMDeploy proxy exited:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return "(no log)"


def make_proxy(workdir: Path, *args: str, env: dict[str, str] | None = None) -> HarnessProxy:
    """A proxy definition (not started): ``args`` are proxy flags such as ``--api-keys K``."""
    workdir.mkdir(parents=True, exist_ok=True)
    return HarnessProxy(python=ensure_harness_venv(), workdir=workdir, args=list(args), env=dict(env or {}))

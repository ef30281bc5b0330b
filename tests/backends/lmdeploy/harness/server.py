"""Starts LMDeploy api_server nodes (real server, stub engine) as subprocesses on loopback, for tests and the bench."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ....waiting import wait_ready
from .model_dir import write_model_dir
from .venv import ensure_harness_venv

HERE = Path(__file__).resolve().parent
RUN_SERVER = HERE / "run_server.py"
MODEL_NAME = "stub-model"
API_KEY = "sk-harness"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stub_model_dir(root: Path) -> Path:
    """The weightless model directory, under a neutral name (LMDeploy matches chat templates by path first)."""
    return write_model_dir(root / "stub-chat-model")


@dataclass
class HarnessNode:
    """One api_server process. ``restart()`` brings it back on the same port (a node that dies and returns)."""

    name: str
    python: Path
    model_dir: Path
    workdir: Path
    args: list[str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_path(self) -> Path:
        return self.workdir / f"{self.name}.events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, *, ready_timeout: float = 90.0) -> HarnessNode:
        self.launch()
        return self.wait_ready(ready_timeout)

    def launch(self) -> None:
        """Starts the process without waiting (start several nodes, then ``wait_ready`` each)."""
        command = [
            str(self.python),
            str(RUN_SERVER),
            "serve",
            "api_server",
            str(self.model_dir),
            "--server-name",
            "127.0.0.1",
            "--server-port",
            str(self.port),
            *self.args,
        ]
        env = {
            **os.environ,
            "STUB_EVENT_LOG": str(self.events_path),
            "STUB_NODE_NAME": self.name,
            "UVICORN_LOG_LEVEL": "warning",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def wait_ready(self, ready_timeout: float = 90.0) -> HarnessNode:
        if wait_ready(f"{self.url}/health", timeout=ready_timeout, alive=self._alive):
            return self
        self.kill()
        raise RuntimeError(f"LMDeploy node {self.name} not healthy after {ready_timeout} s:\n{self._log_tail()}")

    def _alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"LMDeploy node {self.name} exited:\n{self._log_tail()}")

    def kill(self) -> None:
        """Dies at once, like a crashed node (connections are reset, the port refuses)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> HarnessNode:
        self.kill()
        return self.start()

    def events(self, **match: Any) -> list[dict[str, Any]]:
        """The stub engine's event log (start, finish, fail, cancel, closed), filtered by equal fields."""
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            event = json.loads(line)
            if all(event.get(k) == v for k, v in match.items()):
                out.append(event)
        return out

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return "(no log)"


def make_node(workdir: Path, name: str, *args: str, model_dir: Path | None = None) -> HarnessNode:
    """A node definition (not started): ``args`` are api_server flags such as ``--api-keys K``."""
    workdir.mkdir(parents=True, exist_ok=True)
    python = ensure_harness_venv()
    model = model_dir or stub_model_dir(workdir)
    return HarnessNode(name=name, python=python, model_dir=model, workdir=workdir, args=list(args))

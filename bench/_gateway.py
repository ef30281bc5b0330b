"""What the benchmark scripts share: a free loopback port, a process's CPU time (by thread), and a gateway to measure.

The scripts run as ``python bench/NAME.py``, so this module is importable as ``_gateway``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(path: Path) -> tuple[str, list[str]]:
    """A /proc ``stat`` file: the command name, and the fields after it (the state first); OSError once gone."""
    head, tail = path.read_text().rsplit(")", 1)  # the name may hold spaces and parentheses: split at the last
    return head.split("(", 1)[1], tail.split()


def _user_system(fields: list[str]) -> tuple[float, float]:
    """User and system CPU seconds from a ``stat`` file's fields (after the name)."""
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (all its threads), from /proc; 0 once it is gone."""
    try:
        _, fields = _stat(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0
    return sum(_user_system(fields))


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """User and system CPU seconds of one process's threads, by kind: ``loop`` (the main thread, which runs the
    event loop), ``zmq`` (ZeroMQ's I/O threads), ``other`` (worker pools); empty once the process is gone."""
    kinds: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kinds
    for tid in tids:
        try:
            name, fields = _stat(Path(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue  # the thread ended meanwhile
        kind = "loop" if int(tid) == pid else "zmq" if name.startswith("ZMQbg") else "other"
        user, system = _user_system(fields)
        so_far = kinds.get(kind, (0.0, 0.0))
        kinds[kind] = (so_far[0] + user, so_far[1] + system)
    return kinds


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (a gateway's engine worker processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(entry / "stat")[1][1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _flat(server: dict[str, Any]) -> dict[str, Any]:
    """``server`` settings in sections, written flat (``runtime.workers`` -> ``workers``) for a checkout older than
    the sections, which reads only flat keys."""
    flat: dict[str, Any] = {}
    for key, value in server.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def serve_gateway(
    config: dict[str, Any], *, label: str = "gateway", timeout: float = 180.0, source: Path | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Starts ``deepinfer-gateway serve`` with ``config`` on a free port and waits until ``/ready`` is 200; with
    ``source`` (another checkout's ``src``, e.g. a worktree of main) the gateway runs that code, with this
    environment's dependencies, so two versions can be measured interleaved in one run (a checkout older than the
    ``server`` sections, such as 95ad04b, gets its server settings written flat).

    Returns the process, its base URL and the config file (the caller removes it)."""
    port = free_port()
    if source is not None and not (source / "gateway" / "server_config.py").exists():
        config = {**config, "server": _flat(config.get("server", {}))}
    path = Path(tempfile.mkdtemp()) / "bench.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)]
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return process, base_url, path
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"{label} did not become ready in {timeout:.0f} s")

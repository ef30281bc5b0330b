"""Helpers for tests that run the gateway, its nodes or its ranks as operating-system processes: a free port,
a process's children read from ``/proc``, and the gateway's readiness over HTTP."""

from __future__ import annotations

import socket
from pathlib import Path

from .waiting import answers

RANK_WORKER = b"backends.workers.worker"
"""In the command line of a rank worker process."""


def free_port() -> int:
    """A loopback port nothing listens on now (for a process that binds it itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def command_line(pid: int) -> bytes:
    """The process's command line; empty once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def front_ends(supervisor: int) -> set[int]:
    """The supervisor's front-end processes (not its rank workers, nor the spawn context's resource tracker)."""
    return {
        child
        for child in children(supervisor)
        if (command := command_line(child)) and b"resource_tracker" not in command and RANK_WORKER not in command
    }


def ranks(supervisor: int) -> set[int]:
    """The rank worker processes the supervisor hosts for its front ends."""
    return {child for child in children(supervisor) if RANK_WORKER in command_line(child)}


def descendants(pid: int) -> set[int]:
    out = set()
    for child in children(pid):
        out |= {child, *descendants(child)} if Path(f"/proc/{child}").exists() else set()
    return out


def is_ready(base: str) -> bool:
    """Whether the gateway at ``base`` answers ``/ready`` with 200 now."""
    return answers(f"{base}/ready")

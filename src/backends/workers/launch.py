"""How a local rank's worker process is planned, started and explained when it ends."""

from __future__ import annotations

import os
import signal
import socket as socketlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.workers.spec import DISPATCHER_LEASE_SECONDS, WorkerSpec
from backends.workers.startup import LaunchStatus, read_failure

FIRST_LAUNCH = LaunchStatus(1, "", 0.0)


@dataclass
class WorkerPlan:
    """Where the ranks run and how a worker builds its engine (``factory`` is ``module:function``)."""

    size: int
    factory: str
    options: dict[str, Any] = field(default_factory=dict)
    lockstep: bool = False
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    remote_endpoints: list[str] = field(default_factory=list)
    """Ranks started elsewhere (``tcp://host:port`` each, one per rank): connected to, never spawned or killed."""
    rank_env: Callable[[int], dict[str, str]] | None = None
    """Extra environment per local rank (e.g. its GPUs)."""
    restart_backoff: float = 0.5
    """The first restart's delay; it doubles with each failure in a row, up to ``max_backoff``."""
    max_backoff: float = 30.0
    stable_seconds: float = 30.0
    """A rank up this long has its backoff reset."""
    start_timeout: float = 1800.0
    """A rank not ready this long after its launch is killed and counted as failed (generous: DeepInfer loading a
    large model from shared storage takes many minutes, and a deadline hit by a healthy start would repeat)."""
    heartbeat_timeout: float = 10.0
    """A rank silent this long is declared dead (workers report at least every second, and after each step)."""
    lease_seconds: float = DISPATCHER_LEASE_SECONDS
    """Local ranks: a dispatcher silent this long loses its requests on the rank (it pings every second)."""
    keys: str | None = None
    """``rank_keys``: the directory of CURVE key files the rank plane uses over TCP (``backends/workers/keys.py``)."""

    def spawn(
        self, index: int, endpoint: str, collective: str | None, status: LaunchStatus = FIRST_LAUNCH
    ) -> RankProcess:
        """Starts rank ``index``'s worker process on ``endpoint``, as launch ``status.launch`` (it waits
        ``status.delay`` before building its engine); raises ``OSError`` when it cannot be spawned."""
        read, write = os.pipe()
        spec = WorkerSpec(
            index,
            self.size,
            endpoint,
            self.factory,
            self.options,
            self.lockstep,
            collective,
            os.getpid(),
            self.lease_seconds,
            status.launch,
            status.after,
            status.delay,
            write,
            self.keys,
        )
        env = dict(os.environ)
        if self.rank_env is not None:
            env.update(self.rank_env(index))
        try:
            return RankProcess(
                [sys.executable, "-m", "backends.workers.worker", spec.to_json()],
                read,
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(write,),
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)


class RankProcess(subprocess.Popen[bytes]):
    """A rank worker process we started, with the pipe on which it says why its engine failed."""

    def __init__(self, args: list[str], failure_fd: int, **options: Any) -> None:
        super().__init__(args, **options)
        self._failure_fd: int | None = failure_fd

    def end_reason(self) -> str:
        """Why it ended, once it has exited: the engine's failure as it wrote it, else its exit status."""
        code = self.wait()
        written = ""
        if self._failure_fd is not None:
            written = read_failure(self._failure_fd)
            self._failure_fd = None
        return f"engine failed: {written}" if written else f"worker exited with {describe_exit(code)}"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def free_port(host: str) -> int:
    """A port the kernel has free now, for a local worker to bind (tcp transport)."""
    with socketlib.socket(socketlib.AF_INET, socketlib.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])

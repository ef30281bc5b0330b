"""The rank plane's authentication: ZeroMQ CURVE with keys from a directory of key files (``rank_keys``), as a
Kubernetes Secret mounts them.

A rank reached over TCP takes BATCH, RESET and STOP only from dispatchers whose public key is in its directory:
its socket is a CURVE server and a ZAP handler (pyzmq's ``zmq.auth``) admits the ``*.key`` files found there, so a
peer without a key, or with a key not listed, never completes the handshake and no message of it reaches the rank.
The files, in ZeroMQ's certificate format (``deepinfer-gateway rank-keys DIR`` writes them):

- ``rank.key_secret``: the ranks' key pair (the ranks need it; so does whatever stops them, ``ranks``' node);
- ``rank.key``: the ranks' public key (the dispatchers need it to know they talk to the real ranks);
- ``gateway.key_secret``: the dispatchers' key pair (the gateway's front ends);
- every ``*.key``: a public key the ranks admit (``gateway.key``, and ``rank.key`` for the node that stops them).

Sockets over ``ipc://`` (a file in a directory only this user can enter) are not reachable from outside the pod
and stay unauthenticated; a rank that would bind a TCP address beyond the loopback without keys refuses to start.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from backends.errors import RankKeysError

RANK_KEY = "rank"
"""``rank.key`` / ``rank.key_secret``: the ranks' key pair."""
GATEWAY_KEY = "gateway"
"""``gateway.key`` / ``gateway.key_secret``: the dispatchers' key pair."""
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a name in an endpoint) is reachable only from this host."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: another host, as far as the configuration can tell


def exposed(endpoint: str) -> bool:
    """A TCP endpoint beyond the loopback: a peer from another host may reach it, so it needs keys."""
    return is_tcp(endpoint) and not is_loopback(urlsplit(endpoint).hostname or "")


@dataclass(frozen=True)
class RankKeys:
    """The key files of one directory; which of them a side needs is checked when it uses them."""

    directory: Path

    def _pair(self, name: str) -> tuple[bytes, bytes]:
        path = self.directory / f"{name}{SECRET_SUFFIX}"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise RankKeysError(f"rank_keys: cannot read the key pair {path}: {exc}") from exc
        if secret is None:
            raise RankKeysError(f"rank_keys: {path} holds no secret key")
        return public, secret

    def rank_public(self) -> bytes:
        """The ranks' public key: from ``rank.key`` (or the key pair, on a host that holds it)."""
        path = self.directory / f"{RANK_KEY}{PUBLIC_SUFFIX}"
        if not path.exists():
            return self._pair(RANK_KEY)[0]
        try:
            return zmq.auth.load_certificate(path)[0]
        except (OSError, ValueError) as exc:
            raise RankKeysError(f"rank_keys: cannot read the ranks' public key {path}: {exc}") from exc

    def client_pair(self) -> tuple[bytes, bytes]:
        """The key pair a dispatcher (or a node stopping its ranks) presents: the gateway's, else the ranks'."""
        if (self.directory / f"{GATEWAY_KEY}{SECRET_SUFFIX}").exists():
            return self._pair(GATEWAY_KEY)
        return self._pair(RANK_KEY)

    def admitted(self) -> int:
        """How many public keys the ranks admit (every ``*.key`` file)."""
        return len(zmq.auth.load_certificates(self.directory))

    def serve(self, socket: zmq.Socket, context: zmq.Context) -> ThreadAuthenticator:
        """Makes ``socket`` (before it binds) a CURVE server that admits the directory's public keys; returns the
        ZAP handler (a thread of this process), to stop when the socket closes."""
        public, secret = self._pair(RANK_KEY)
        if not self.admitted():
            raise RankKeysError(f"rank_keys: no public key (*{PUBLIC_SUFFIX}) in {self.directory} to admit")
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(self.directory))
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True
        return authenticator

    def connect_as_client(self, socket: zmq.Socket) -> None:
        """Makes ``socket`` (before it connects) present this side's key pair and check the ranks' key."""
        public, secret = self.client_pair()
        socket.curve_serverkey = self.rank_public()
        socket.curve_publickey = public
        socket.curve_secretkey = secret


def keys_for(endpoint: str, directory: str | None) -> RankKeys | None:
    """The keys a socket at ``endpoint`` uses: CURVE over TCP when the backend has ``rank_keys`` (the loopback
    included, so both sides agree from the endpoint alone), none over ipc. Raises for a TCP endpoint beyond the
    loopback without keys."""
    if directory is None:
        if exposed(endpoint):
            raise RankKeysError(
                f"{endpoint} is reachable from other hosts: the rank plane needs rank_keys there (CURVE; "
                "`deepinfer-gateway rank-keys DIR` creates them), or bind to 127.0.0.1"
            )
        return None
    return RankKeys(Path(directory)) if is_tcp(endpoint) else None


def create_keys(directory: Path) -> list[Path]:
    """Writes a new ranks' key pair and dispatchers' key pair into ``directory`` (created if missing, refused if
    it holds key files already); secret files are readable by their owner only. Returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"{name}{suffix}" for name in (RANK_KEY, GATEWAY_KEY) for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)]
    present = [name for name in names if (directory / name).exists()]
    if present:
        raise RankKeysError(f"{directory} already holds {', '.join(present)}: keys are never overwritten")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".rank-keys-") as scratch:
        for name in (RANK_KEY, GATEWAY_KEY):
            zmq.auth.create_certificates(scratch, name)
        for name in names:
            target = directory / name
            shutil.move(os.path.join(scratch, name), target)
            target.chmod(0o600 if name.endswith(SECRET_SUFFIX) else 0o644)
    return [directory / name for name in names]

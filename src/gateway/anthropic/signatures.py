"""Thinking-block signatures: an HMAC-SHA256 of the reasoning under a server secret, checked when a client replays
the block, so the model is only ever shown reasoning this gateway produced.

A signature is URL-safe base64 of one version byte, the 32-byte MAC and, when the reply left the reasoning out
(``thinking.display: "omitted"``), the reasoning itself, zlib-compressed, so that replaying the empty block gives
the model its reasoning back. That is authentication, not encryption: whoever holds the signature can read it.

The secret is ``server.auth.thinking_signature_key``; without one, a random key kept in the cache directory
(``$DEEPINFER_GATEWAY_CACHE/thinking-signature.key``, created once per host), which every process of a host shares.
Replicas on several hosts need the same configured key to accept each other's signatures.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import zlib
from pathlib import Path

KEY_FILE_NAME = "thinking-signature.key"
KEY_BYTES = 32
_PLAIN = 1  # MAC of the reasoning the block shows
_EMBEDDED = 2  # MAC of the compressed reasoning the signature carries, then that reasoning
_MAC_BYTES = 32
_CONTEXT = b"deepinfer-gateway thinking signature\x00"


class ThinkingSigner:
    """Signs the reasoning of a reply and checks the signatures clients send back."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a thinking-signature key needs at least 16 bytes")
        self._key = key

    @classmethod
    def from_secret(cls, secret: str) -> ThinkingSigner:
        """A signer for a configured secret (any length of text: it is hashed into the key)."""
        return cls(hashlib.sha256(_CONTEXT + secret.encode()).digest())

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, _CONTEXT + data, hashlib.sha256).digest()

    def sign(self, reasoning: str, *, embed: bool = False) -> str:
        """The signature of ``reasoning``; with ``embed`` it carries the reasoning (the block shows none)."""
        if embed:
            packed = zlib.compress(reasoning.encode(), 6)
            payload = bytes([_EMBEDDED]) + self._mac(packed) + packed
        else:
            payload = bytes([_PLAIN]) + self._mac(reasoning.encode())
        return base64.urlsafe_b64encode(payload).decode("ascii")

    def verify(self, thinking: str, signature: str) -> str | None:
        """The reasoning a replayed thinking block stands for, or None when ``signature`` is not this gateway's
        signature of it (altered text, another server's signature, garbage)."""
        try:
            payload = base64.urlsafe_b64decode(signature.encode("ascii"))
        except (binascii.Error, UnicodeEncodeError, ValueError):
            return None
        if len(payload) < 1 + _MAC_BYTES:
            return None
        version, mac, rest = payload[0], payload[1 : 1 + _MAC_BYTES], payload[1 + _MAC_BYTES :]
        if version == _PLAIN and not rest:
            return thinking if hmac.compare_digest(mac, self._mac(thinking.encode())) else None
        if version == _EMBEDDED and hmac.compare_digest(mac, self._mac(rest)):
            reasoning = zlib.decompress(rest).decode()  # ours, since the MAC matched: no bomb, valid UTF-8
            return reasoning if thinking in ("", reasoning) else None
        return None


def host_key(cache_dir: Path) -> bytes:
    """The host's signing key in ``cache_dir``, created (readable by its owner only) if there is none yet; several
    processes starting at once agree on one, since the file appears complete or not at all."""
    path = cache_dir / KEY_FILE_NAME
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{KEY_FILE_NAME}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(KEY_BYTES))
        try:
            os.link(partial, path)  # fails if another process linked its key first: that one wins
        except FileExistsError:
            pass
        finally:
            partial.unlink()
        key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} is not a thinking-signature key ({len(key)} bytes, expected {KEY_BYTES})")
    return key


def default_cache_dir() -> Path:
    """``$DEEPINFER_GATEWAY_CACHE`` or ``~/.cache/deepinfer-gateway``."""
    configured = os.environ.get("DEEPINFER_GATEWAY_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "deepinfer-gateway"


def signer_for(secret: str | None) -> ThinkingSigner:
    """The signer of a gateway: its configured secret, else the host's key."""
    if secret is not None:
        return ThinkingSigner.from_secret(secret)
    return ThinkingSigner(host_key(default_cache_dir()))

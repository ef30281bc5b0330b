"""Thinking signatures: only this gateway's, for exactly the reasoning it signed, replay."""

from __future__ import annotations

import base64
import multiprocessing
from pathlib import Path

import pytest

from gateway.anthropic.signatures import KEY_BYTES, ThinkingSigner, host_key

REASONING = "The user greets me; a short greeting back will do."


def test_a_signature_verifies_its_reasoning_and_nothing_else() -> None:
    signer = ThinkingSigner.from_secret("a secret of some length")
    signature = signer.sign(REASONING)
    assert signer.verify(REASONING, signature) == REASONING
    assert signer.verify(REASONING + " ", signature) is None, "edited text"
    assert signer.verify("", signature) is None, "a plain signature carries no reasoning"
    assert ThinkingSigner.from_secret("another secret, other key").verify(REASONING, signature) is None
    forged = base64.urlsafe_b64encode(b"\x01" + bytes(32)).decode()
    for garbage in ("", "not base64 at all!", forged, signature[:-4], "EqQBCkYIBxgCKkD" * 4):
        assert signer.verify(REASONING, garbage) is None


def test_an_embedded_signature_gives_the_reasoning_back_to_an_empty_block() -> None:
    signer = ThinkingSigner.from_secret("a secret of some length")
    signature = signer.sign(REASONING * 40, embed=True)
    assert len(signature) < len(REASONING * 40), "the reasoning travels compressed"
    assert signer.verify("", signature) == REASONING * 40
    assert signer.verify(REASONING * 40, signature) == REASONING * 40
    assert signer.verify("something else", signature) is None
    payload = bytearray(base64.urlsafe_b64decode(signature))
    payload[-1] ^= 1
    assert signer.verify("", base64.urlsafe_b64encode(bytes(payload)).decode()) is None, "a changed payload"


def _host_key(directory: str) -> bytes:
    return host_key(Path(directory))


def test_processes_of_one_host_share_one_key_created_once(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        keys = pool.map(_host_key, [str(tmp_path)] * 8)
    assert len(set(keys)) == 1 and len(keys[0]) == KEY_BYTES
    key_file = tmp_path / "thinking-signature.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [key_file.name], "no partial key files left behind"
    assert host_key(tmp_path) == keys[0]


def test_a_key_file_that_is_not_a_key_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "thinking-signature.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="not a thinking-signature key"):
        host_key(tmp_path)

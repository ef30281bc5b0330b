"""``server`` settings live in sections (http, auth, limits, streams, stores, runtime, batches, tracing); the flat
keys of the previous release still work, from the file and the environment, with a DeprecationWarning and a log
line that name each key's new place."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.server_config import FLAT_KEYS, ServerConfig

FLAT_YAML = """
server:
  port: 7000
  api_keys: [sk-0123456789]
  max_n: 4
  request_timeout: 30
  responses_store: memory
  drain_seconds: 5
"""
SECTIONED_YAML = """
server:
  http: {port: 7000}
  auth: {api_keys: [sk-0123456789]}
  limits: {max_n: 4}
  streams: {request_timeout: 30}
  stores: {responses_store: memory}
  runtime: {drain_seconds: 5}
"""


def _load(tmp_path: Path, text: str, **flags: object) -> ServerConfig:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path, **flags).server


def test_flat_keys_read_as_their_sections_with_a_warning_and_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning, match="server.port is now server.http"):
        flat = _load(tmp_path, FLAT_YAML)
    assert "server.request_timeout is now server.streams.request_timeout" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sectioned = _load(tmp_path, SECTIONED_YAML)
    assert flat == sectioned
    assert (flat.http.port, flat.limits.max_n, flat.streams.request_timeout, flat.runtime.drain_seconds) == (
        7000,
        4,
        30,
        5,
    )


def test_a_flat_environment_variable_still_overrides_a_sectioned_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "7100")
    with pytest.warns(DeprecationWarning, match="server.port"):
        server = _load(tmp_path, SECTIONED_YAML)
    assert server.http.port == 7100 and server.limits.max_n == 4


def test_the_sectioned_environment_variable_overrides_the_file_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_SERVER__STREAMS__IDLE_TIMEOUT", "12")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        server = _load(tmp_path, SECTIONED_YAML)
    assert server.streams.idle_timeout == 12 and server.streams.request_timeout == 30


def test_command_line_flags_set_their_sections_without_a_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        server = _load(tmp_path, SECTIONED_YAML, host="0.0.0.0", port=7200, log_level="debug")
    assert (server.http.host, server.http.port, server.runtime.log_level) == ("0.0.0.0", 7200, "debug")


def test_a_flat_attribute_reads_and_writes_its_section() -> None:
    server = ServerConfig(streams={"request_timeout": 9})
    assert server.request_timeout == 9  # type: ignore[attr-defined]
    server.request_timeout = 3  # type: ignore[attr-defined]
    assert server.streams.request_timeout == 3


def test_every_flat_key_has_a_section_field_of_the_same_name() -> None:
    defaults = ServerConfig()
    for key, section in FLAT_KEYS.items():
        assert key in type(getattr(defaults, section)).model_fields, f"server.{section}.{key}"


def test_a_misspelt_key_inside_a_section_is_rejected_naming_its_path(tmp_path: Path) -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=r"server\.http\.prot"):
        _load(tmp_path, "server:\n  http: {prot: 1}\n")

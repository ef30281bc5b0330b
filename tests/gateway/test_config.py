"""Configuration: YAML file, environment overrides, defaults, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.config import ReferenceBackendConfig
from gateway.config import DEFAULT_MODEL_NAME, ConfigError, load_config


def test_no_file_serves_the_reference_engine_on_localhost_8000() -> None:
    config = load_config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert isinstance(config.backends[0], ReferenceBackendConfig)
    assert config.models[0].name == DEFAULT_MODEL_NAME


def test_environment_overrides_the_file_and_flags_override_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 7000\n  log_level: warning\n")
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "7100")
    config = load_config(path)
    assert config.server.port == 7100 and config.server.log_level == "warning"
    assert load_config(path, port=7200).server.port == 7200


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("server:\n  prot: 1\n", "server.prot"),
        ("backends:\n  - name: a\n    kind: quantum\nmodels: []\n", "backends[0]"),
        (
            "backends:\n  - {name: a, kind: reference}\n  - {name: a, kind: reference}\n"
            "models:\n  - {name: m, backends: [a]}\n",
            "duplicate backend name",
        ),
        ("backends:\n  - {name: a, kind: reference}\nmodels: []\n", "at least one model"),
        (
            "backends:\n  - {name: a, kind: reference}\n"
            "models:\n  - {name: m, backends: [a], aliases: [n]}\n  - {name: n, backends: [a]}\n",
            "duplicate model name(s) or alias(es) ['n']",
        ),
        (
            "backends:\n  - {name: a, kind: reference}\nmodels:\n  - {name: m, backends: [a], aliases: ['']}\n",
            "aliases[0]",
        ),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("server: {port: [\n", "not valid YAML"),
    ],
)
def test_invalid_config_is_rejected_naming_the_problem(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=r".*") as caught:
        load_config(path)
    assert needle in str(caught.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")

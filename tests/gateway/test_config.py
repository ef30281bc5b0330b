"""Configuration: YAML file, environment overrides, defaults, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.config import ReferenceBackendConfig
from gateway.config import DEFAULT_MODEL_NAME, ConfigError, load_config


def test_no_file_serves_the_reference_engine_on_localhost_8000() -> None:
    config = load_config()
    assert (config.server.http.host, config.server.http.port) == ("127.0.0.1", 8000)
    assert isinstance(config.backends[0], ReferenceBackendConfig)
    assert config.models[0].name == DEFAULT_MODEL_NAME


def test_environment_overrides_the_file_and_flags_override_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  http:\n    port: 7000\n  runtime:\n    log_level: warning\n")
    monkeypatch.setenv("GATEWAY_SERVER__HTTP__PORT", "7100")
    config = load_config(path)
    assert config.server.http.port == 7100 and config.server.runtime.log_level == "warning"
    assert load_config(path, port=7200).server.http.port == 7200


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
        (
            "server:\n  auth:\n    api_keys:\n"
            "      - {key: sk-0123456789, service_tiers: [flex], default_service_tier: priority}\n",
            "default_service_tier: 'priority' is not among service_tiers ['flex']",
        ),
        (
            "backends:\n  - {name: a, kind: reference, tiers: {gold: {max_queue: 1}}}\nmodels:\n"
            "  - {name: m, backends: [a]}\n",
            "backends[0].tiers.gold",
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


OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_tracing_is_off_unless_an_endpoint_or_the_otlp_exporter_is_configured(
    tmp_path: Path, otel_env: pytest.MonkeyPatch
) -> None:
    assert not load_config().server.tracing.active
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  tracing:\n    endpoint: http://collector:4318/\n")
    tracing = load_config(path).server.tracing
    assert tracing.active and tracing.traces_url() == "http://collector:4318/v1/traces"
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not load_config(path).server.tracing.active
    otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert load_config().server.tracing.traces_url() == "http://localhost:4318/v1/traces", "OTLP's default"
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert not load_config(path).server.tracing.active


def test_otel_variables_override_server_tracing(tmp_path: Path, otel_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "server:\n  tracing:\n    endpoint: http://file:4318\n    service_name: from-file\n"
        "    headers: {authorization: file}\n    resource_attributes: {team: a, region: eu}\n    sampler: always_on\n"
    )
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318")
    otel_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=generic")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20t0ken,x-tenant=7")
    otel_env.setenv("OTEL_SERVICE_NAME", "gateway-eu")
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=b,deployment.environment=prod")
    otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
    tracing = load_config(path).server.tracing
    assert tracing.traces_url() == "http://env:4318/v1/traces"
    assert tracing.headers == {"authorization": "Bearer t0ken", "x-tenant": "7"}, "the traces variable wins"
    assert tracing.service_name == "gateway-eu"
    assert tracing.resource_attributes == {"team": "b", "region": "eu", "deployment.environment": "prod"}
    assert (tracing.sampler, tracing.sampler_arg, tracing.timeout) == ("parentbased_traceidratio", 0.25, 3.0)
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://env:4318/custom/traces")
    assert load_config(path).server.tracing.traces_url() == "http://env:4318/custom/traces", "a full URL as is"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_RESOURCE_ATTRIBUTES", "team"),
        ("OTEL_TRACES_SAMPLER_ARG", "lots"),
    ],
)
def test_an_otel_variable_the_gateway_cannot_honour_is_an_error_naming_it(
    otel_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    otel_env.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        load_config()

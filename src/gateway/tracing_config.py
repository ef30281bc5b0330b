"""``server.tracing``: OpenTelemetry traces over OTLP/HTTP, configured the OpenTelemetry way.

Every field mirrors a standard ``OTEL_*`` environment variable, and the variable wins when it is set (the
environment overrides the file, as ``GATEWAY_*`` variables do): a deployment that injects ``OTEL_*`` variables
(an OpenTelemetry Operator, a Helm chart) needs no change to the gateway's file. The signal-specific variable
(``OTEL_EXPORTER_OTLP_TRACES_*``) wins over the generic one (``OTEL_EXPORTER_OTLP_*``), as the SDK has it.
Tracing is off unless configured: an OTLP endpoint (here or in the environment), ``enabled: true`` or
``OTEL_TRACES_EXPORTER=otlp`` turns it on; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turns it off.

This module needs no OpenTelemetry package: the gateway imports the SDK (``gateway.tracing``) only when tracing
is on, from the ``tracing`` extra.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any, Literal, get_args
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, model_validator

Sampler = Literal[
    "always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
    "parentbased_traceidratio",
]  # fmt: skip
SAMPLERS: tuple[str, ...] = get_args(Sampler)
DEFAULT_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "/v1/traces"

# field -> the variables that set it, the signal-specific one first
_VARIABLES: dict[str, tuple[str, ...]] = {
    "endpoint": ("OTEL_EXPORTER_OTLP_ENDPOINT",),
    "traces_endpoint": ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",),
    "protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    "headers": ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"),
    "timeout": ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
    "compression": ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"),
    "service_name": ("OTEL_SERVICE_NAME",),
    "resource_attributes": ("OTEL_RESOURCE_ATTRIBUTES",),
    "sampler": ("OTEL_TRACES_SAMPLER",),
    "sampler_arg": ("OTEL_TRACES_SAMPLER_ARG",),
}


class TracingConfig(BaseModel):
    """Where and how the gateway exports its traces (see the module docstring for the environment variables)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        None,
        description="OTEL_TRACES_EXPORTER (otlp / none); null: on when an OTLP endpoint is configured",
    )
    endpoint: str | None = Field(
        None, description=f"OTEL_EXPORTER_OTLP_ENDPOINT: the collector's base URL ({TRACES_PATH} is appended)"
    )
    traces_endpoint: str | None = Field(
        None, description="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: the full URL spans are posted to"
    )
    protocol: Literal["http/protobuf"] = Field(
        "http/protobuf", description="OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL: OTLP over HTTP with protobuf bodies"
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="OTEL_EXPORTER_OTLP_[TRACES_]HEADERS: sent with every export", repr=False
    )
    timeout: float = Field(10.0, gt=0, description="OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT: seconds per export")
    compression: Literal["none", "gzip", "deflate"] = Field(
        "none", description="OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION"
    )
    service_name: str = Field("deepinfer-gateway", min_length=1, description="OTEL_SERVICE_NAME")
    resource_attributes: dict[str, str] = Field(
        default_factory=dict, description="OTEL_RESOURCE_ATTRIBUTES (its entries are added over these)"
    )
    sampler: Sampler = Field(
        "parentbased_always_on", description="OTEL_TRACES_SAMPLER: parentbased_* follow the caller's sampled flag"
    )
    sampler_arg: float = Field(
        1.0, ge=0, le=1, description="OTEL_TRACES_SAMPLER_ARG: the share of traces kept by the traceidratio samplers"
    )

    @model_validator(mode="before")
    @classmethod
    def _environment_wins(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        return apply_environment(dict(data), os.environ)

    @property
    def active(self) -> bool:
        """Whether the gateway traces requests."""
        if self.enabled is not None:
            return self.enabled
        return self.endpoint is not None or self.traces_endpoint is not None

    def unavailable(self) -> str | None:
        """Why tracing cannot start although it is on (the OpenTelemetry packages are missing), else None."""
        if not self.active:
            return None
        for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                return f"server.tracing is on but {module} is not installed: pip install 'deepinfer-gateway[tracing]'"
        return None

    def traces_url(self) -> str:
        """The URL spans are posted to: the traces endpoint, else the base endpoint (or the default) + /v1/traces."""
        if self.traces_endpoint:
            return self.traces_endpoint
        return (self.endpoint or DEFAULT_ENDPOINT).rstrip("/") + TRACES_PATH


def apply_environment(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``data`` (the file's ``server.tracing``) with every field that an ``OTEL_*`` variable sets replaced by it.

    Raises ``ValueError`` naming the variable for a value the gateway cannot use."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        data["enabled"] = False
    else:
        exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporter in ("otlp", "none"):
            data["enabled"] = exporter == "otlp"
        elif exporter:
            raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r}: the gateway exports traces with 'otlp' (or 'none')")
    for field, names in _VARIABLES.items():
        name = next((n for n in names if environ.get(n, "").strip()), None)
        if name is None:
            continue
        raw = environ[name].strip()
        if field == "protocol" and raw != "http/protobuf":
            raise ValueError(
                f"{name}={raw!r}: the gateway exports OTLP over HTTP ('http/protobuf'); "
                "point it at the collector's OTLP/HTTP port (4318)"
            )
        if field == "sampler" and raw not in SAMPLERS:
            raise ValueError(f"{name}={raw!r}: one of {', '.join(SAMPLERS)}")
        if field == "resource_attributes":
            data[field] = {**(data.get(field) or {}), **parse_pairs(name, raw)}
        elif field == "headers":
            data[field] = parse_pairs(name, raw)
        elif field in ("timeout", "sampler_arg"):
            try:
                data[field] = float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: not a number") from None
        else:
            data[field] = raw
    return data


def parse_pairs(name: str, raw: str) -> dict[str, str]:
    """``key=value,key2=value2`` with percent-encoded values, as ``OTEL_RESOURCE_ATTRIBUTES`` and the OTLP headers
    variables are written."""
    pairs: dict[str, str] = {}
    for entry in raw.split(","):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{name}: {entry.strip()!r} is not key=value")
        pairs[unquote(key.strip())] = unquote(value.strip())
    return pairs

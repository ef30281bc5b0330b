"""Gateway configuration: one YAML file, overridable by ``GATEWAY_*`` environment variables.

Environment variables win over the file: ``GATEWAY_SERVER__HTTP__PORT=9000`` sets ``server.http.port``, and a list such
as ``GATEWAY_MODELS='[{"name": "m", "backends": ["b"]}]'`` replaces the whole list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.config import BackendConfig, ReferenceBackendConfig
from gateway.server_config import FLAT_KEYS, ServerConfig

DEFAULT_MODEL_NAME = "deepinfer-reference"
DEFAULT_BACKEND_NAME = "reference"


class TargetConfig(BaseModel):
    """One backend behind a model with its share of the traffic (``backends`` entries may also be plain names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(min_length=1)
    weight: float = Field(
        1.0, ge=0, description="relative share (capacity) of the target; 0: only pinned requests or as a fallback"
    )


def _target_entry(value: Any) -> str | TargetConfig:
    """A backend name stays a name (so old configs read as before); a mapping is a ``TargetConfig``."""
    if isinstance(value, str):
        if not value:
            raise ValueError("a backend name must not be empty")
        return value
    if isinstance(value, TargetConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError("expected a backend name or a mapping {backend: NAME, weight: W}")
    return TargetConfig.model_validate(value)


TargetEntry = Annotated[
    str | TargetConfig,
    PlainValidator(_target_entry),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "object",
                    "properties": {"backend": {"type": "string"}, "weight": {"type": "number", "minimum": 0}},
                    "required": ["backend"],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]


class ShadowConfig(BaseModel):
    """Mirror a fraction of the model's requests to another backend and compare the answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(min_length=1)
    fraction: float = Field(ge=0, le=1, description="share of the model's requests mirrored")
    max_concurrency: int = Field(4, ge=1, description="shadow requests running at once; more are dropped, not queued")


class AffinityConfig(BaseModel):
    """How ``prefix_affinity`` keys requests and how much busier than its share a target may get."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_chars: int = Field(1024, ge=1, description="characters of the prompt that make the affinity key")
    load_factor: float = Field(
        1.5, ge=1, description="a target takes at most this many times its share of in-flight requests ..."
    )
    load_slack: int = Field(4, ge=0, description="... plus this many, so low traffic keeps its affinity")


class CircuitBreakerConfig(BaseModel):
    """When a target stops getting requests after failures, and when it is probed again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_threshold: int = Field(5, ge=1, description="consecutive failures that open the circuit")
    cooldown_seconds: float = Field(10.0, gt=0, description="open time before one probe request is let through")


class ModelConfig(BaseModel):
    """A public model name, the backends that serve it, and how requests are spread over them."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    aliases: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="other names clients may send for this model (Claude Code's --model and small-fast model, "
        "an SDK's default); they are served, listed and counted as the model itself",
    )
    backends: list[TargetEntry] = Field(min_length=1, description="backend names or {backend, weight} mappings")
    policy: Literal["weighted", "least_outstanding", "prefix_affinity"] = "weighted"
    fallbacks: list[str] = Field(
        default_factory=list, description="tried in order when the chosen target fails before its first token"
    )
    shadow: ShadowConfig | None = None
    allow_pin_header: bool = Field(False, description="let clients choose a target with the X-Backend header")
    affinity: AffinityConfig = AffinityConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()

    def targets(self) -> list[TargetConfig]:
        """``backends`` with every entry as a ``TargetConfig``."""
        return [TargetConfig(backend=b) if isinstance(b, str) else b for b in self.backends]

    @field_validator("backends")
    @classmethod
    def _distinct_targets(cls, entries: list[str | TargetConfig]) -> list[str | TargetConfig]:
        names = [e if isinstance(e, str) else e.backend for e in entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"backend(s) {twice} listed more than once")
        if all(not isinstance(e, str) and e.weight == 0 for e in entries):
            raise ValueError("at least one backend needs a weight above 0")
        return entries

    @field_validator("fallbacks")
    @classmethod
    def _distinct_fallbacks(cls, names: list[str]) -> list[str]:
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"backend(s) {twice} listed more than once")
        return names


class GatewayConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", env_nested_delimiter="__", extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)  # built per config: server.tracing reads OTEL_*
    backends: list[BackendConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings  # the environment overrides the file

    @model_validator(mode="after")
    def _defaults_and_references(self) -> GatewayConfig:
        if not self.backends and not self.models:
            self.backends = [ReferenceBackendConfig(name=DEFAULT_BACKEND_NAME)]
            self.models = [ModelConfig(name=DEFAULT_MODEL_NAME, backends=[DEFAULT_BACKEND_NAME])]
        names = [b.name for b in self.backends]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"backends: duplicate backend name(s) {duplicates}")
        model_names = [name for m in self.models for name in (m.name, *m.aliases)]
        duplicates = sorted({n for n in model_names if model_names.count(n) > 1})
        if duplicates:
            raise ValueError(f"models: duplicate model name(s) or alias(es) {duplicates}")
        if not self.models:
            raise ValueError("models: at least one model must be served")
        for i, model in enumerate(self.models):
            for j, target in enumerate(model.targets()):
                if target.backend not in names:
                    raise ValueError(
                        f"models[{i}].backends[{j}]: unknown backend {target.backend!r} (declared: {names})"
                    )
            for j, name in enumerate(model.fallbacks):
                if name not in names:
                    raise ValueError(f"models[{i}].fallbacks[{j}]: unknown backend {name!r} (declared: {names})")
            if model.shadow is not None and model.shadow.backend not in names:
                raise ValueError(
                    f"models[{i}].shadow.backend: unknown backend {model.shadow.backend!r} (declared: {names})"
                )
        return self


class ConfigError(Exception):
    """The configuration is invalid; the message names every bad key."""


def load_config(path: Path | None = None, **overrides: Any) -> GatewayConfig:
    """Reads the YAML file (if any), applies environment variables, then explicit overrides (CLI flags)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded or {}
    try:
        config = GatewayConfig(**data)
        server_overrides = {k: v for k, v in overrides.items() if v is not None}
        if server_overrides:
            config.server = _overridden(config.server, server_overrides)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source=str(path) if path else "configuration")) from exc
    return config


def _overridden(server: ServerConfig, overrides: dict[str, Any]) -> ServerConfig:
    """``server`` with command-line values (``--host``, ``--port``, ``--log-level``) set in their sections."""
    merged = server.model_dump()
    for key, value in overrides.items():
        merged[FLAT_KEYS[key]][key] = value
    return ServerConfig(**merged)


def format_validation_error(exc: ValidationError, *, source: str) -> str:
    lines = [f"invalid {source}:"]
    for error in exc.errors():
        loc = _dotted(error["loc"])
        lines.append(f"  {loc or '(top level)'}: {error['msg']}")
    return "\n".join(lines)


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("reference", "deepinfer", "lmdeploy") and out.endswith("]"):
            continue  # pydantic's discriminated-union tag adds noise, not a key
        else:
            out += f".{part}" if out else str(part)
    return out

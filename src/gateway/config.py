"""Gateway configuration: one YAML file, overridable by ``GATEWAY_*`` environment variables.

Environment variables win over the file: ``GATEWAY_SERVER__PORT=9000`` sets ``server.port``, and a list such as
``GATEWAY_MODELS='[{"name": "m", "backends": ["b"]}]'`` replaces the whole list.
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
from gateway.batches.config import BatchesConfig
from gateway.tracing_config import TracingConfig

DEFAULT_MODEL_NAME = "deepinfer-reference"
DEFAULT_BACKEND_NAME = "reference"


ServiceTierName = Literal["priority", "default", "flex", "batch"]


def _online_tiers() -> list[ServiceTierName]:
    return ["priority", "default", "flex"]


class ApiKeyConfig(BaseModel):
    """A client key with its own limits; a plain string in ``server.api_keys`` means default limits."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=8, repr=False)
    name: str | None = Field(None, description="label for logs and metrics (the key itself is never logged)")
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    service_tiers: list[ServiceTierName] = Field(
        default_factory=_online_tiers,
        min_length=1,
        description="service tiers the key may use; a request for another gets the key's default_service_tier",
    )
    default_service_tier: ServiceTierName | None = Field(
        None,
        description="the tier of requests that name none (or auto); unset: default if the key may use it, else "
        "its best allowed tier",
    )
    weight: float = Field(1.0, gt=0, description="the key's share of a backend against other keys in one tier")

    @model_validator(mode="after")
    def _default_tier_is_allowed(self) -> ApiKeyConfig:
        if self.default_service_tier is not None and self.default_service_tier not in self.service_tiers:
            raise ValueError(
                f"default_service_tier: {self.default_service_tier!r} is not among service_tiers {self.service_tiers}"
            )
        return self


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")
    access_log: bool = Field(True, description="one structured log line per request")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    max_n: int = Field(16, ge=1, description="upper bound for the n parameter")
    gil_switch_interval: float = Field(
        0.0005, gt=0, le=0.1, description="seconds; short so the engine thread gets the GIL back quickly"
    )
    api_keys: list[str | ApiKeyConfig] = Field(
        default_factory=list, description="client keys for /v1 (Bearer or x-api-key); empty: no auth", repr=False
    )
    admin_api_key: str | None = Field(
        None,
        min_length=8,
        description="protects /metrics and /admin; with api_keys set and no admin key, both are refused (403)",
        repr=False,
    )
    public_metrics: bool = Field(
        False, description="serve /metrics without a key (its labels name models, backends and API keys)"
    )
    thinking_signature_key: str | None = Field(
        None,
        min_length=16,
        description="secret that signs /v1/messages thinking blocks (replicas on several hosts need the same); "
        "unset: a random key kept in $DEEPINFER_GATEWAY_CACHE, shared by the processes of one host",
        repr=False,
    )
    requests_per_minute: int | None = Field(None, ge=1, description="default per-key request limit")
    tokens_per_minute: int | None = Field(None, ge=1, description="default per-key token limit")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    request_timeout: float | None = Field(600.0, gt=0, description="total deadline of one request, seconds")
    idle_timeout: float | None = Field(120.0, gt=0, description="longest wait for the next token, seconds")
    stream_buffer_tokens: int | None = Field(
        2048,
        ge=16,
        description="most output tokens held for one request whose client has not taken them; beyond: the "
        "request is stopped (slow_client); null: no bound",
    )
    stall_timeout: float | None = Field(
        30.0, gt=0, description="seconds a stream may wait for its client to accept data before it is stopped"
    )
    ping_seconds: float | None = Field(
        15.0,
        gt=0,
        description="seconds of silence after which a stream gets a `: ping` comment, so proxies keep it open; "
        "null: never",
    )
    gc_tuning: bool = Field(True, description="gc.freeze() after start-up and a larger young-generation threshold")
    header_timeout: float | None = Field(
        10.0,
        gt=0,
        description="seconds a client has to send a request's headers, from connecting or from the first byte of "
        "the next request on a keep-alive connection; slower ones get 408 and are closed (slowloris); null: none",
    )
    body_timeout: float | None = Field(
        30.0,
        gt=0,
        description="seconds a client has to send a request's whole body once its headers are in; slower ones get "
        "408 and are closed (slow bodies); null: none",
    )
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="larger request line + headers get 431")
    max_connections: int | None = Field(
        2048, ge=1, description="open HTTP connections; past it a new connection gets 503 and is closed"
    )
    probe_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="a second listener (on server.host) that serves only /health, /ready and /metrics, with a cap "
        "of its own, so clients filling max_connections never starve probes; null: probes share the API port",
    )
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection is kept")
    json_parse_processes: int = Field(
        1, ge=0, le=32, description="child processes that parse request bodies of 512 KiB or more; 0: the event loop"
    )
    max_messages: int = Field(2048, ge=1, description="upper bound for messages in a chat request")
    max_tools: int = Field(128, ge=0, description="upper bound for tools in a chat request")
    responses_store: str = Field(
        "sqlite",
        pattern=r"^(memory|sqlite|sqlite://.+|state_store|(redis|rediss|unix)://.+)$",
        description="where /v1/responses keeps stored responses: sqlite (responses.sqlite3 in "
        "$DEEPINFER_GATEWAY_CACHE or ~/.cache/deepinfer-gateway), sqlite://PATH, memory (one process), "
        "redis://host:port/db (a Redis or Valkey of their own, shared by every replica), or state_store (the "
        "Redis of server.state_store, shared with the budgets)",
        repr=False,
    )
    responses_max_age: float | None = Field(
        30 * 24 * 3600.0, gt=0, description="seconds a stored response is kept; null: forever"
    )
    responses_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="bytes of stored responses (response plus input items, serialized) a store keeps at most; "
        "past it the oldest are dropped",
    )
    token_reservation: int = Field(
        512,
        ge=0,
        description="output tokens a request reserves from its key's tokens_per_minute when it names no "
        "max_tokens (its prompt estimate comes on top); settled with what it used when it ends",
    )
    state_store: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="redis://host:port/db: per-key budgets (and stored responses) shared by every process and "
        "replica; unset: each process keeps its own, each with 1/workers of every budget",
        repr=False,
    )
    workers: int = Field(
        1, ge=1, le=256, description="front-end processes serving one port (uvicorn workers); see README, Scale out"
    )
    batches: BatchesConfig = Field(
        default_factory=BatchesConfig,
        description="the Batch API (/v1/files, /v1/batches): its store, limits and concurrency (README, Batch API)",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces over OTLP/HTTP; OTEL_* environment variables override it (README, Traces)",
    )

    @model_validator(mode="after")
    def _probe_port_is_its_own(self) -> ServerConfig:
        if self.probe_port is not None and self.probe_port != 0 and self.probe_port == self.port:
            raise ValueError(
                f"probe_port: {self.probe_port} is server.port; the probe listener needs a port of its own"
            )
        return self

    @model_validator(mode="after")
    def _responses_store_exists(self) -> ServerConfig:
        if self.responses_store == "state_store" and self.state_store is None:
            raise ValueError("responses_store: state_store needs server.state_store (redis://...)")
        if self.responses_store == "memory" and self.workers > 1:
            raise ValueError(
                "responses_store: memory keeps responses in one process, and with server.workers > 1 a request "
                "that continues one (previous_response_id) may reach another process: use sqlite (shared by the "
                "processes of a host) or redis://..."
            )
        return self

    @model_validator(mode="after")
    def _batch_store_exists(self) -> ServerConfig:
        if self.batches.store == "state_store" and (self.state_store is None or self.batches.files_dir is None):
            raise ValueError(
                "batches.store: state_store needs server.state_store (redis://...) and batches.files_dir (a folder "
                "every replica mounts, for the files' contents)"
            )
        return self

    def client_keys(self) -> list[ApiKeyConfig]:
        return [ApiKeyConfig(key=k) if isinstance(k, str) else k for k in self.api_keys]


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
            merged = {**config.server.model_dump(), **server_overrides}
            config.server = ServerConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source=str(path) if path else "configuration")) from exc
    return config


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

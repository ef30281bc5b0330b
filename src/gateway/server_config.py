"""The ``server`` part of the configuration, in sections: ``http`` (the listener), ``auth`` (keys), ``limits``
(request bounds and key budgets), ``streams`` (deadlines and slow clients), ``stores`` (shared state), ``runtime``
(the process), ``batches`` and ``tracing``. Each section is one concern an operator tunes on its own.

The flat keys of earlier releases (``server.port``, ``server.api_keys``, ...) are still read, from the file and
from ``GATEWAY_SERVER__*`` variables, with a ``DeprecationWarning`` and a log line naming their new place; they go in
the next release. In Python, ``server.port`` and the like still read and write the sectioned value.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.batches.config import BatchesConfig
from gateway.tracing_config import TracingConfig

logger = logging.getLogger(__name__)

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


class HttpConfig(BaseModel):
    """The HTTP listener: address, connection caps and the time and size a client may take."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    probe_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="a second listener (on server.host) that serves only /health, /ready and /metrics, with a cap "
        "of its own, so clients filling max_connections never starve probes; null: probes share the API port",
    )
    max_connections: int | None = Field(
        2048, ge=1, description="open HTTP connections; past it a new connection gets 503 and is closed"
    )
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection is kept")
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
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    json_parse_processes: int = Field(
        1, ge=0, le=32, description="child processes that parse request bodies of 512 KiB or more; 0: the event loop"
    )

    @model_validator(mode="after")
    def _probe_port_is_its_own(self) -> HttpConfig:
        if self.probe_port is not None and self.probe_port != 0 and self.probe_port == self.port:
            raise ValueError(f"probe_port: {self.probe_port} is http.port; the probe listener needs a port of its own")
        return self


class AuthConfig(BaseModel):
    """Who may call: client keys, the operator key, and the secret that signs thinking blocks."""

    model_config = ConfigDict(extra="forbid")

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

    def client_keys(self) -> list[ApiKeyConfig]:
        return [ApiKeyConfig(key=k) if isinstance(k, str) else k for k in self.api_keys]


class LimitsConfig(BaseModel):
    """How much one request and one key may ask for: parameter bounds and per-key budgets."""

    model_config = ConfigDict(extra="forbid")

    max_n: int = Field(16, ge=1, description="upper bound for the n parameter")
    max_messages: int = Field(2048, ge=1, description="upper bound for messages in a chat request")
    max_tools: int = Field(128, ge=0, description="upper bound for tools in a chat request")
    requests_per_minute: int | None = Field(None, ge=1, description="default per-key request limit")
    tokens_per_minute: int | None = Field(None, ge=1, description="default per-key token limit")
    token_reservation: int = Field(
        512,
        ge=0,
        description="output tokens a request reserves from its key's tokens_per_minute when it names no "
        "max_tokens (its prompt estimate comes on top); settled with what it used when it ends",
    )


class StreamsConfig(BaseModel):
    """How long a request and its stream may take, and what a stream holds for a slow client."""

    model_config = ConfigDict(extra="forbid")

    request_timeout: float | None = Field(600.0, gt=0, description="total deadline of one request, seconds")
    idle_timeout: float | None = Field(120.0, gt=0, description="longest wait for the next token, seconds")
    stall_timeout: float | None = Field(
        30.0, gt=0, description="seconds a stream may wait for its client to accept data before it is stopped"
    )
    ping_seconds: float | None = Field(
        15.0,
        gt=0,
        description="seconds of silence after which a stream gets a `: ping` comment, so proxies keep it open; "
        "null: never",
    )
    stream_buffer_tokens: int | None = Field(
        2048,
        ge=16,
        description="most output tokens held for one request whose client has not taken them; beyond: the "
        "request is stopped (slow_client); null: no bound",
    )


class StoresConfig(BaseModel):
    """Where shared state lives: the Redis of budgets, and stored Responses API responses."""

    model_config = ConfigDict(extra="forbid")

    state_store: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="redis://host:port/db: per-key budgets (and stored responses) shared by every process and "
        "replica; unset: each process keeps its own, each with 1/workers of every budget",
        repr=False,
    )
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


class RuntimeConfig(BaseModel):
    """The process: front-end workers, draining, logging and interpreter tuning."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(
        1, ge=1, le=256, description="front-end processes serving one port (uvicorn workers); see README, Scale out"
    )
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")
    access_log: bool = Field(True, description="one structured log line per request")
    gc_tuning: bool = Field(True, description="gc.freeze() after start-up and a larger young-generation threshold")
    gil_switch_interval: float = Field(
        0.0005, gt=0, le=0.1, description="seconds; short so the engine thread gets the GIL back quickly"
    )


FLAT_KEYS: dict[str, str] = {
    "host": "http",
    "port": "http",
    "probe_port": "http",
    "max_connections": "http",
    "keep_alive_timeout": "http",
    "header_timeout": "http",
    "body_timeout": "http",
    "max_header_bytes": "http",
    "max_body_bytes": "http",
    "json_parse_processes": "http",
    "api_keys": "auth",
    "admin_api_key": "auth",
    "public_metrics": "auth",
    "thinking_signature_key": "auth",
    "max_n": "limits",
    "max_messages": "limits",
    "max_tools": "limits",
    "requests_per_minute": "limits",
    "tokens_per_minute": "limits",
    "token_reservation": "limits",
    "request_timeout": "streams",
    "idle_timeout": "streams",
    "stall_timeout": "streams",
    "ping_seconds": "streams",
    "stream_buffer_tokens": "streams",
    "state_store": "stores",
    "responses_store": "stores",
    "responses_max_age": "stores",
    "responses_max_bytes": "stores",
    "workers": "runtime",
    "drain_seconds": "runtime",
    "log_level": "runtime",
    "access_log": "runtime",
    "gc_tuning": "runtime",
    "gil_switch_interval": "runtime",
}
"""Every flat key of earlier releases and the section it now lives in, under the same name."""


def sectioned(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a ``server`` mapping) with its flat keys moved into their sections; warns once per mapping. A flat
    key wins over the same key in its section: environment variables override the file, and old deployments set
    ``GATEWAY_SERVER__PORT`` over a file written in sections."""
    flat = [key for key in data if key in FLAT_KEYS]
    if not flat:
        return data
    message = "deprecated flat server keys (read for one more release): " + ", ".join(
        f"server.{key} is now server.{FLAT_KEYS[key]}.{key}" for key in flat
    )
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logger.warning(message)
    out = {key: value for key, value in data.items() if key not in FLAT_KEYS}
    for key in flat:
        section = FLAT_KEYS[key]
        current = out.get(section) or {}
        if isinstance(current, BaseModel):
            current = current.model_dump(exclude_unset=True)
        out[section] = {**current, key: data[key]}
    return out


class ServerConfig(BaseModel):
    """Everything about the gateway process that is not a backend or a model, in sections."""

    model_config = ConfigDict(extra="forbid")

    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    streams: StreamsConfig = Field(default_factory=StreamsConfig)
    stores: StoresConfig = Field(default_factory=StoresConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    batches: BatchesConfig = Field(
        default_factory=BatchesConfig,
        description="the Batch API (/v1/files, /v1/batches): its store, limits and concurrency (README, Batch API)",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces over OTLP/HTTP; OTEL_* environment variables override it (README, Traces)",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_move_to_sections(cls, data: Any) -> Any:
        return sectioned(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _responses_store_exists(self) -> ServerConfig:
        stores = self.stores
        if stores.responses_store == "state_store" and stores.state_store is None:
            raise ValueError("stores.responses_store: state_store needs stores.state_store (redis://...)")
        if stores.responses_store == "memory" and self.runtime.workers > 1:
            raise ValueError(
                "stores.responses_store: memory keeps responses in one process, and with runtime.workers > 1 a "
                "request that continues one (previous_response_id) may reach another process: use sqlite (shared "
                "by the processes of a host) or redis://..."
            )
        return self

    @model_validator(mode="after")
    def _batch_store_exists(self) -> ServerConfig:
        if self.batches.store == "state_store" and (self.stores.state_store is None or self.batches.files_dir is None):
            raise ValueError(
                "batches.store: state_store needs stores.state_store (redis://...) and batches.files_dir (a folder "
                "every replica mounts, for the files' contents)"
            )
        return self


def _forwarded(section: str, key: str) -> property:
    """``server.<key>`` as it was before sections: reads and writes ``server.<section>.<key>``."""

    def read(server: ServerConfig) -> Any:
        return getattr(getattr(server, section), key)

    def write(server: ServerConfig, value: Any) -> None:
        setattr(getattr(server, section), key, value)

    return property(read, write, doc=f"Deprecated: ``{section}.{key}``.")


for _key, _section in FLAT_KEYS.items():
    setattr(ServerConfig, _key, _forwarded(_section, _key))

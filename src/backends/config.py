"""Configuration of each backend kind, as it appears under ``backends:`` in the gateway's YAML file."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, model_validator

_ENDPOINT = r"^(tcp://[^:/]+:\d+|ipc:///.+)$"
"""A rank worker's ZeroMQ endpoint (``worker_endpoints``)."""
_RANK_KEYS_HELP = (
    "directory of the rank plane's CURVE key files (rank.key_secret, rank.key, gateway.key_secret, admitted *.key), "
    "as a Kubernetes Secret mounts it; required for ranks reached or bound over TCP beyond the loopback "
    "(`deepinfer-gateway rank-keys DIR` creates them; docs/data-parallel.md, Several hosts)"
)


def _check_rank_keys(endpoints: list[str], rank_keys: str | None) -> None:
    """Ranks another host can reach take commands only from dispatchers holding a key (CURVE)."""
    from backends.workers.keys import exposed

    open_to_others = [e for e in endpoints if exposed(e)]
    if open_to_others and rank_keys is None:
        raise ValueError(
            f"worker_endpoints {open_to_others} are reached over TCP beyond the loopback: set rank_keys (CURVE keys; "
            "`deepinfer-gateway rank-keys DIR` creates them), or keep every rank on 127.0.0.1 or ipc://"
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierQueue(_Strict):
    """One service tier's queue in front of a backend; unset fields follow the backend's ``max_queue`` and its
    ``queue_timeout`` scaled by the tier (README, Flow control)."""

    max_queue: int | None = Field(None, ge=0, description="requests of the tier that may wait; beyond: 503")
    queue_timeout: float | None = Field(None, gt=0, description="longest wait of the tier's requests before a 503")


class AdmissionConfig(_Strict):
    """Admission control the gateway applies in front of every backend (docs: README, Flow control)."""

    max_in_flight: int | None = Field(1024, ge=1, description="requests admitted at once; null: no bound")
    max_queue: int = Field(256, ge=0, description="requests of one service tier that may wait for a slot; beyond: 503")
    queue_timeout: float = Field(
        30.0,
        gt=0,
        description="longest wait for a slot of a default-tier request before a 503 (priority: 1/6 of it, flex 4 "
        "times, batch 20 times, unless tiers says otherwise)",
    )
    tiers: dict[Literal["priority", "default", "flex", "batch"], TierQueue] = Field(
        default_factory=dict, description="per service tier: its own max_queue and queue_timeout"
    )
    flow_control: Literal["fair", "fifo"] = Field(
        "fair",
        description="fair: service tiers first, then weighted fair sharing between keys and vLLM's priority; fifo: "
        "one first-come queue (tiers, weights and priority ignored)",
    )


_HOST_ENTRY = re.compile(r"^((\*\.)?[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?)$")
"""An allowlist entry: a host name, ``*.`` and a domain, or an address (IPv6 bracketed or not)."""


class ImageUrlsConfig(_Strict):
    """http(s) image URLs in requests (README, Image URLs). Off while ``allowed_hosts`` is empty: data URLs and base64
    images are taken, a URL is a 400. When on, every fetch connects only to public addresses of allowlisted hosts,
    redirects included, and is bounded in bytes and time."""

    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="hosts image URLs may name: exact names, or *.example.com for its subdomains; empty: URLs off",
    )
    max_bytes: int = Field(20 * 1024 * 1024, ge=1, description="largest image one URL may deliver")
    fetch_timeout: float = Field(
        10.0, gt=0, description="seconds one fetch may take, waiting for a fetch thread included; past it: a 400"
    )
    fetch_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="fetches at once; a host that never answers holds its thread until it lets go, so at most "
        "this many threads can be held",
    )

    @model_validator(mode="after")
    def _host_names(self) -> ImageUrlsConfig:
        for entry in self.allowed_hosts:
            if not _HOST_ENTRY.match(entry):
                raise ValueError(
                    f"allowed_hosts entry {entry!r} is not a host name (no scheme, port or path; *. only in front)"
                )
        return self


class ImageSettings(_Strict):
    """Image inputs of V4.1 chats: what one request may send and how many images a process decodes at once.

    Images come as data URLs or base64; ``http(s)`` URLs only from the hosts ``image_urls`` allows.
    """

    max_images: int = Field(8, ge=0, le=1024, description="images in one request; 0: images refused")
    max_image_bytes: int = Field(
        10 * 1024 * 1024, ge=1, description="encoded bytes of one image (after base64 decoding); beyond: 413"
    )
    max_total_bytes: int = Field(
        20 * 1024 * 1024, ge=1, description="encoded bytes of all images of one request; beyond: 413"
    )
    max_pixels: int = Field(
        7680 * 4320, ge=1, description="width x height of one image as sent (before resizing); beyond: 400"
    )
    max_concurrent_decodes: int = Field(
        4, ge=1, le=1024, description="images this backend decodes and resizes at once in one process"
    )


class _Preparation(AdmissionConfig):
    """How an in-process engine backend prepares prompts (docs: README, Security and limits)."""

    images: ImageSettings = Field(default_factory=ImageSettings, description="image inputs (README, Images)")

    prepare_threads: int = Field(
        2,
        ge=1,
        le=64,
        description="threads that render chat templates, tokenize prompts and compile output grammars, so that "
        "neither the event loop (/health) nor the engine thread waits on a huge prompt",
    )
    image_urls: ImageUrlsConfig = Field(
        default_factory=ImageUrlsConfig, description="http(s) image URLs: off unless hosts are allowlisted"
    )


class TimingModel(_Strict):
    """Imitates an accelerator's step times so load tests on a CPU look like a real deployment."""

    prefill_seconds_per_token: float = Field(0.0, ge=0)
    decode_seconds_per_step: float = Field(0.0, ge=0)
    tokens_per_step: int = Field(1, ge=1, le=16, description="tokens accepted per decode step (speculation)")


class ReferenceBackendConfig(_Preparation):
    """The CPU reference engine: DeepInfer's engine API on a tiny n-gram language model."""

    name: str
    kind: Literal["reference"] = "reference"
    max_model_len: int = Field(4096, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    seed: int | None = Field(None, description="seed for requests that bring none; unset: random like DeepInfer")
    default_thinking: bool = Field(False, description="thinking mode for chats that do not ask (docs/deepseek.md)")
    timing: TimingModel = TimingModel()
    prefix_cache_tokens: int = Field(
        0,
        ge=0,
        description="prompt tokens each engine's prefix cache keeps (LRU, whole blocks); a hit skips their prefill "
        "time and is reported as prompt_cache_hit_tokens; 0: no prefix cache",
    )
    prefix_cache_block_size: int = Field(16, ge=1, le=4096, description="tokens per prefix-cache block")
    # Data parallelism (docs/data-parallel.md): one engine per rank, each in its own worker process.
    data_parallel_size: int = Field(1, ge=1, le=256, description="engine ranks; above 1, one worker process each")
    worker_processes: bool | None = Field(
        None, description="run the engine(s) in worker processes; default: only when data_parallel_size > 1"
    )
    lockstep: bool = Field(False, description="ranks step together, as DeepInfer's DP collectives require")
    worker_transport: Literal["ipc", "tcp"] = Field("ipc", description="how local workers are reached")
    worker_endpoints: list[Annotated[str, Field(pattern=_ENDPOINT)]] = Field(
        default_factory=list,
        description="ranks started elsewhere (deepinfer-gateway ranks), one tcp://host:port (or ipc:///path on "
        "this host) each",
    )
    rank_keys: str | None = Field(None, description=_RANK_KEYS_HELP)

    @model_validator(mode="after")
    def _check_data_parallel(self) -> ReferenceBackendConfig:
        if self.worker_endpoints and len(self.worker_endpoints) != self.data_parallel_size:
            raise ValueError("worker_endpoints must list exactly data_parallel_size endpoints, one per rank")
        _check_rank_keys(self.worker_endpoints, self.rank_keys)
        if self.worker_processes is False and (self.data_parallel_size > 1 or self.worker_endpoints):
            raise ValueError("data_parallel_size > 1 and worker_endpoints need worker processes")
        return self

    @property
    def uses_workers(self) -> bool:
        """Whether the engines run in worker processes (``DataParallelBackend``) rather than in the gateway."""
        if self.worker_processes is not None:
            return self.worker_processes
        return self.data_parallel_size > 1 or bool(self.worker_endpoints)


class DeepInferBackendConfig(_Preparation):
    """DeepSeek's DeepInfer engine, in process or one worker per DP rank (SM100 / Ascend 950); docs/deepinfer.md.

    Every field maps to DeepInfer's ``EngineArgs`` or to the process environment the engine reads; checks that
    DeepInfer would only make with an ``assert`` deep inside construction are made here, so a bad file fails
    ``config check`` instead of a GPU start-up minutes later.
    """

    name: str
    kind: Literal["deepinfer"] = "deepinfer"
    model: str = Field(description="local model directory, or a repo id already in the Hugging Face cache")
    revision: str | None = Field(None, description="branch, tag or commit of a repo id in the HF cache (main)")
    tokenizer: str | None = Field(None, description="tokenizer directory; default: the model directory")
    served_model_name: str | None = Field(None, description="the engine's own label in its logs; default: name")
    max_model_len: int = Field(ge=16, description="required: DeepInfer's default of 4096 must not leak through")
    max_num_seqs: int = Field(256, ge=1, description="running requests per engine step (sizes CUDA graphs)")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per prefill step; unset: derived")
    expert_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1, description="GPUs this process drives (CP ranks)")
    data_parallel_size: int = Field(
        1, ge=1, le=256, description="DP ranks; above 1, one worker process per rank, stepping in lockstep"
    )
    master_addr: str = Field(
        "127.0.0.1", description="MASTER_ADDR of DeepInfer's torch.distributed rendezvous (DP > 1: rank 0's host)"
    )
    master_port: int | None = Field(
        None,
        ge=51,
        le=65535,
        description="MASTER_PORT (DeepInfer listens on MASTER_PORT - 50); unset: a free port per launch",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    chunked_prefill: bool = False
    stop_preempted_request: bool = Field(
        True, description="KV pressure ends the longest request (503 insufficient_system_resource) vs recomputes it"
    )
    log_stats: bool = Field(False, description="DeepInfer's own [stats] log lines; /metrics works either way")
    seed: int = Field(0, ge=0, description="engine RNG seed; per-request sampling seeds come from requests")
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy: synthetic weights (smoke tests)")
    trust_remote_code: bool = False
    default_thinking: bool = Field(
        True, description="thinking mode for chats that do not ask: on, as DeepSeek serves V4.1 (docs/deepseek.md)"
    )
    accelerator: Literal["nvidia", "ascend"] = "nvidia"
    visible_devices: str | None = Field(
        None,
        pattern=r"^\d+(,\d+)*$",
        description="CUDA_VISIBLE_DEVICES (and ASCEND_RT_VISIBLE_DEVICES on Ascend), driver GPU first; with "
        "data_parallel_size N, rank r gets the r-th group of context_parallel_size devices; "
        "unset: the process's own value, else the first context_parallel_size x data_parallel_size devices",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="variables set before deepinfer is imported (DEEPINFER_*, NCCL_*, ...)"
    )
    worker_endpoints: list[Annotated[str, Field(pattern=_ENDPOINT)]] = Field(
        default_factory=list,
        description="ranks started elsewhere (deepinfer-gateway ranks), one tcp://host:port (or ipc:///path on "
        "this host) per DP rank, in rank order; the gateway connects to them and never starts or stops them",
    )
    rank_keys: str | None = Field(None, description=_RANK_KEYS_HELP)

    @property
    def uses_workers(self) -> bool:
        """Whether this gateway process reaches its engine(s) in rank worker processes (``DataParallelBackend``)."""
        return self.data_parallel_size > 1 or bool(self.worker_endpoints)

    @model_validator(mode="after")
    def _check_engine_arguments(self) -> DeepInferBackendConfig:
        if self.worker_endpoints and len(self.worker_endpoints) != self.data_parallel_size:
            raise ValueError("worker_endpoints must list exactly data_parallel_size endpoints, one per rank")
        _check_rank_keys(self.worker_endpoints, self.rank_keys)
        cp, dp, ep = self.context_parallel_size, self.data_parallel_size, self.expert_parallel_size
        if (cp * dp) % ep:
            raise ValueError(
                f"expert_parallel_size ({ep}) must divide context_parallel_size x data_parallel_size ({cp * dp}): "
                "DeepInfer shards experts over the GPUs of its ranks"
            )
        if self.visible_devices is not None:
            devices = self.visible_devices.split(",")
            if len(devices) < cp * dp:
                raise ValueError(
                    f"visible_devices must list at least context_parallel_size x data_parallel_size ({cp * dp}) "
                    "devices: every DP rank drives its own context_parallel_size devices"
                )
            if len(set(devices)) != len(devices):
                raise ValueError("visible_devices lists a device twice; ranks must not share a device")
        for key in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"env: {key!r} is not an environment variable name (A-Z, 0-9, _)")
            if key in _DEVICE_VARIABLES:
                raise ValueError(f"env: set {key} with visible_devices, not env")
            if key in _RENDEZVOUS_VARIABLES and dp > 1:
                raise ValueError(f"env: set {key} with {key.lower()}, not env (it is per launch of the DP group)")
        for key, check in _ENV_CHECKS.items():
            value = self.env.get(key)
            if value is not None and not check(value):
                raise ValueError(f"env: {key}={value!r} is not a valid value ({_ENV_HINTS[key]})")
        nextn = self.env.get("DEEPINFER_USE_NEXTN_DECODE")  # unset here: the process environment's, checked at start
        if self.max_num_batched_tokens is not None:
            if nextn is not None and self.max_num_batched_tokens < self.max_num_seqs * (1 + int(nextn)):
                raise ValueError(
                    f"max_num_batched_tokens must be at least max_num_seqs x (1 + DEEPINFER_USE_NEXTN_DECODE) "
                    f"= {self.max_num_seqs * (1 + int(nextn))}"
                )
            if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError("max_num_batched_tokens below max_model_len needs chunked_prefill: true")
        if self.accelerator == "ascend" and _deepinfer_bool(self.env.get("DEEPINFER_BATCH_INVARIANT", "0")):
            raise ValueError("env: DEEPINFER_BATCH_INVARIANT is NVIDIA-only; DeepInfer refuses it on Ascend")
        return self


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_DEVICE_VARIABLES = frozenset({"CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"})
_RENDEZVOUS_VARIABLES = frozenset({"MASTER_ADDR", "MASTER_PORT"})


def _deepinfer_bool(value: str) -> bool:
    """DeepInfer's reading of a boolean variable: false for 0, empty, false and False."""
    return value not in ("0", "", "false", "False")


def _int_at_least(minimum: int) -> Callable[[str], bool]:
    def check(value: str) -> bool:
        return value.strip().lstrip("-").isdigit() and int(value) >= minimum

    return check


_ENV_CHECKS: dict[str, Callable[[str], bool]] = {
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": _int_at_least(1),
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": _int_at_least(1),
    "DEEPINFER_USE_NEXTN_DECODE": _int_at_least(0),
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": _int_at_least(0),
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": lambda v: v in ("off", "mask", "compact"),
}
_ENV_HINTS = {
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "an integer >= 1",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "an integer >= 1",
    "DEEPINFER_USE_NEXTN_DECODE": "an integer >= 0; 0 turns speculative decoding off",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "an integer >= 0",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "off, mask or compact",
}


class LMDeployBackendConfig(AdmissionConfig):
    """One or more LMDeploy ``api_server`` nodes or proxies reached over HTTP (see docs/lmdeploy.md)."""

    name: str
    kind: Literal["lmdeploy"] = "lmdeploy"
    urls: list[HttpUrl] = Field(min_length=1, description="base URLs of the api_server nodes, without /v1")
    node_kind: Literal["auto", "api_server", "proxy"] = Field(
        "auto",
        description="what the urls are: api_server nodes, LMDeploy proxies (lmdeploy serve proxy), or auto "
        "(a url whose /health is 404 and whose /nodes/status answers is a proxy)",
    )
    api_key: str | None = Field(None, description="bearer token the nodes were started with (--api-keys)")
    model: str | None = Field(None, description="upstream model name; discovered from each node's /v1/models if unset")
    model_map: dict[str, str] = Field(
        default_factory=dict, description="public model name -> upstream name (e.g. a LoRA adapter); wins over model"
    )
    max_model_len: int | None = Field(
        None, ge=16, description="the nodes' --session-len: the max_tokens sent when a request gives none"
    )
    max_connections: int = Field(100, ge=1, description="pooled connections to all nodes together")
    keepalive_timeout: float = Field(
        4.0, gt=0, description="seconds an idle pooled connection is kept; below uvicorn's 5 s on the nodes"
    )
    connect_timeout: float = Field(5.0, gt=0)
    first_byte_timeout: float | None = Field(
        None, gt=0, description="seconds to the first stream event (queueing + prefill); unset: read_timeout"
    )
    read_timeout: float = Field(600.0, gt=0, description="seconds a node may stay silent between stream events")
    total_timeout: float | None = Field(None, gt=0, description="upper bound on one upstream request")
    health_interval: float = Field(5.0, gt=0, description="seconds between /health probes of each node")
    health_timeout: float = Field(5.0, gt=0)
    failure_threshold: int = Field(3, ge=1, description="consecutive failed requests that take a node out")
    retries: int = Field(2, ge=0, description="other nodes tried for a request that failed before its first byte")
    logprob_tokens: Literal["byte_level", "raw"] = Field(
        "byte_level", description="byte_level: turn vocabulary spellings (Ġword) into text, as OpenAI reports it"
    )
    vision: Literal["auto", "on", "off"] = Field(
        "auto",
        description="whether image parts go to the nodes: auto asks each node once (a tiny image request), on "
        "forwards them to every node, off refuses them with a 400",
    )
    image_urls: ImageUrlsConfig = Field(
        default_factory=ImageUrlsConfig,
        description="http(s) image URLs: off unless hosts are allowlisted; the gateway fetches them and sends the "
        "bytes, so a node never fetches a URL",
    )


BackendConfig = Annotated[
    ReferenceBackendConfig | DeepInferBackendConfig | LMDeployBackendConfig, Field(discriminator="kind")
]

"""Configuration of each backend kind, as it appears under ``backends:`` in the gateway's YAML file."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TimingModel(_Strict):
    """Imitates an accelerator's step times so load tests on a CPU look like a real deployment."""

    prefill_seconds_per_token: float = Field(0.0, ge=0)
    decode_seconds_per_step: float = Field(0.0, ge=0)
    tokens_per_step: int = Field(1, ge=1, le=16, description="tokens accepted per decode step (speculation)")


class ReferenceBackendConfig(_Strict):
    """The CPU reference engine: DeepInfer's engine API on a tiny n-gram language model."""

    name: str
    kind: Literal["reference"] = "reference"
    max_model_len: int = Field(4096, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    max_in_flight: int | None = Field(1024, ge=1, description="requests admitted at once; null: no bound")
    max_queue: int = Field(256, ge=0, description="requests that may wait for a slot; beyond: 503")
    queue_timeout: float = Field(30.0, gt=0, description="longest wait for a slot before a 503")
    seed: int | None = Field(None, description="seed for requests that bring none; unset: random like DeepInfer")
    timing: TimingModel = TimingModel()


class DeepInferBackendConfig(_Strict):
    """DeepSeek's DeepInfer engine in process (SM100 / Ascend 950)."""

    name: str
    kind: Literal["deepinfer"] = "deepinfer"
    model: str = Field(description="local model directory, or a repo id already in the Hugging Face cache")
    max_model_len: int = Field(ge=16, description="required: DeepInfer's default of 4096 must not leak through")
    max_num_seqs: int = Field(256, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    chunked_prefill: bool = False
    visible_devices: str | None = None
    env: dict[str, str] = Field(default_factory=dict, description="DEEPINFER_* variables set before import")


class LMDeployBackendConfig(_Strict):
    """One or more LMDeploy ``api_server`` nodes reached over HTTP."""

    name: str
    kind: Literal["lmdeploy"] = "lmdeploy"
    urls: list[HttpUrl] = Field(min_length=1)
    api_key: str | None = None
    model: str | None = Field(None, description="upstream model name; discovered from /v1/models if unset")
    max_connections: int = Field(100, ge=1)
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(600.0, gt=0)
    health_interval: float = Field(5.0, gt=0)


BackendConfig = Annotated[
    ReferenceBackendConfig | DeepInferBackendConfig | LMDeployBackendConfig, Field(discriminator="kind")
]

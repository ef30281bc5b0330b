"""The process environment DeepInfer reads, derived from the backend's config and set before the first import.

DeepInfer reads ``CUDA_VISIBLE_DEVICES`` directly in several places (unset: a ``KeyError`` mid-construction), reads
some ``DEEPINFER_*`` variables when ``deepinfer.config`` is imported and caches the others on first access. So the
whole environment is computed and applied on the engine thread before ``deepinfer`` is imported.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from backends.config import DeepInferBackendConfig

logger = logging.getLogger(__name__)

TEXT_SERVING_DEFAULTS: Mapping[str, str] = {
    # DeepInfer's default pins an 8 GiB /dev/shm image pool per rank at construction; text serving needs none.
    "DEEPINFER_USE_MULTIMODAL_POOL": "0",
    # DeepInfer forks its multimodal worker during construction; tokenizers' thread pool must not cross a fork
    # (DeepInfer's own LLM wrapper sets this too).
    "TOKENIZERS_PARALLELISM": "false",
}
"""Defaults the gateway changes for text serving; the process environment and the config's ``env`` win."""


RENDEZVOUS_OFFSET = 50
"""DeepInfer listens on ``MASTER_PORT - 50 + engine_group_rank`` (``deepinfer/utils.py``)."""
SPECULATIVE_TOKENS_DEFAULT = "5"
"""DeepInfer's default ``DEEPINFER_USE_NEXTN_DECODE``: 5 draft tokens per decode step (MTP)."""


class EngineEnvironmentError(ValueError):
    """The process environment contradicts the backend's configuration."""


def engine_environment(config: DeepInferBackendConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set: text-serving defaults unless already set, the config's ``env``, the devices."""
    env = {key: value for key, value in TEXT_SERVING_DEFAULTS.items() if key not in environ}
    accelerator = environ.get("DEEPINFER_ACCELERATOR")
    if accelerator is not None and "DEEPINFER_ACCELERATOR" not in config.env and accelerator != config.accelerator:
        raise EngineEnvironmentError(
            f"DEEPINFER_ACCELERATOR={accelerator} in the environment, but backend {config.name!r} is configured "
            f"for accelerator {config.accelerator!r}"
        )
    env["DEEPINFER_ACCELERATOR"] = config.accelerator  # selects the build of deepinfer._C to load
    env.update(config.env)
    devices = config.visible_devices or environ.get("CUDA_VISIBLE_DEVICES")
    if devices is None and config.accelerator == "ascend":
        devices = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if devices is None:
        devices = ",".join(str(i) for i in range(config.context_parallel_size))
    if not devices.strip():
        raise EngineEnvironmentError("CUDA_VISIBLE_DEVICES is set but empty: no device is visible to DeepInfer")
    env["CUDA_VISIBLE_DEVICES"] = devices
    if config.accelerator == "ascend":
        env["ASCEND_RT_VISIBLE_DEVICES"] = devices  # DeepInfer requires both to name the same NPUs
    if config.data_parallel_size == 1:
        env.update(_single_rank_rendezvous(config, environ))
    _check_batched_tokens(config, env.get("DEEPINFER_USE_NEXTN_DECODE") or environ.get("DEEPINFER_USE_NEXTN_DECODE"))
    return env


def _single_rank_rendezvous(config: DeepInferBackendConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Even one rank meets itself through torch.distributed, at ``MASTER_PORT - 50`` (default 23333 - 50): two
    gateways on one host would collide there, so unless a port is configured or set, each engine gets a free one."""
    env: dict[str, str] = {}
    if "MASTER_ADDR" not in config.env and "MASTER_ADDR" not in environ:
        env["MASTER_ADDR"] = config.master_addr
    if "MASTER_PORT" not in config.env and "MASTER_PORT" not in environ:
        port = config.master_port
        env["MASTER_PORT"] = str(port if port is not None else free_rendezvous_port())
    return env


def free_rendezvous_port() -> int:
    """A ``MASTER_PORT`` whose listening port (``MASTER_PORT - 50``) is free now on every interface."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = int(probe.getsockname()[1])
        if port + RENDEZVOUS_OFFSET <= 65535:
            return port + RENDEZVOUS_OFFSET
    raise OSError("no free port for DeepInfer's rendezvous")


def _check_batched_tokens(config: DeepInferBackendConfig, nextn: str | None) -> None:
    """A decode step schedules ``1 + DEEPINFER_USE_NEXTN_DECODE`` tokens per request, from the config's ``env`` or
    the process environment, whichever DeepInfer will see."""
    speculative = int(nextn if nextn is not None else SPECULATIVE_TOKENS_DEFAULT)
    needed = config.max_num_seqs * (1 + speculative)
    if config.max_num_batched_tokens is not None and config.max_num_batched_tokens < needed:
        raise EngineEnvironmentError(
            f"max_num_batched_tokens {config.max_num_batched_tokens} is below max_num_seqs x (1 + "
            f"DEEPINFER_USE_NEXTN_DECODE={speculative}) = {needed}"
        )


def apply_environment(env: Mapping[str, str]) -> None:
    """Sets the variables in this process, logging the ones that replace a different value."""
    for key, value in env.items():
        previous = os.environ.get(key)
        if previous is not None and previous != value:
            logger.info("deepinfer environment: %s=%s replaces %s", key, value, previous)
        os.environ[key] = value

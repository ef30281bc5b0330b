"""The process environment DeepInfer reads, derived from the backend's config and set before the first import.

DeepInfer reads ``CUDA_VISIBLE_DEVICES`` directly in several places (unset: a ``KeyError`` mid-construction), reads
some ``DEEPINFER_*`` variables when ``deepinfer.config`` is imported and caches the others on first access. So the
whole environment is computed and applied on the engine thread before ``deepinfer`` is imported.
"""

from __future__ import annotations

import logging
import os
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
    return env


def apply_environment(env: Mapping[str, str]) -> None:
    """Sets the variables in this process, logging the ones that replace a different value."""
    for key, value in env.items():
        previous = os.environ.get(key)
        if previous is not None and previous != value:
            logger.info("deepinfer environment: %s=%s replaces %s", key, value, previous)
        os.environ[key] = value

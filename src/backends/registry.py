"""Builds backends from their configuration: the only place the gateway learns which kinds exist."""

from __future__ import annotations

from backends.config import BackendConfig, DeepInferBackendConfig, LMDeployBackendConfig, ReferenceBackendConfig
from backends.interface import Backend


class BackendKindUnavailableError(RuntimeError):
    """The configuration names a backend kind this build cannot serve."""


def build_backend(config: BackendConfig) -> Backend:
    if isinstance(config, ReferenceBackendConfig):
        from backends.reference.backend import build_reference_backend

        return build_reference_backend(config)
    if isinstance(config, DeepInferBackendConfig):
        from backends.deepinfer.backend import build_deepinfer_backend

        return build_deepinfer_backend(config)
    if isinstance(config, LMDeployBackendConfig):
        from backends.lmdeploy import build_lmdeploy_backend

        return build_lmdeploy_backend(config)
    raise BackendKindUnavailableError(f"unknown backend kind in {config!r}")

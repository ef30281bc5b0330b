"""Builds backends from their configuration: the only place the gateway learns which kinds exist."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from backends.config import BackendConfig, DeepInferBackendConfig, LMDeployBackendConfig, ReferenceBackendConfig
from backends.interface import Backend

if TYPE_CHECKING:
    from backends.workers.driver import WorkerPlan


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


def node_worker_plan(config: BackendConfig, ranks: range, master_addr: str | None = None) -> WorkerPlan:
    """How this host runs ``ranks`` of a backend whose ``worker_endpoints`` list ranks on several hosts
    (``deepinfer-gateway ranks``); ``master_addr`` overrides DeepInfer's rendezvous host."""
    if isinstance(config, DeepInferBackendConfig):
        from backends.deepinfer.ranks import node_worker_plan as deepinfer_node_plan

        return deepinfer_node_plan(config, ranks, os.environ, master_addr)
    if isinstance(config, ReferenceBackendConfig):
        from backends.reference.backend import reference_worker_plan

        if config.lockstep and len(ranks) != config.data_parallel_size:
            raise ValueError(f"backend {config.name!r}: a lockstep reference group runs on one node")
        return reference_worker_plan(config)
    raise ValueError(f"backend {config.name!r} ({config.kind}) has no rank workers")

"""Builds backends, and the processes that host their ranks, from their configuration: the only place the gateway
learns which kinds exist."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from backends.config import BackendConfig, DeepInferBackendConfig, LMDeployBackendConfig, ReferenceBackendConfig
from backends.interface import Backend, RankHosting, RankNodeRun

if TYPE_CHECKING:
    from backends.workers.launch import WorkerPlan


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


def hosted_worker_plan(config: BackendConfig) -> WorkerPlan | None:
    """The rank workers the front-end supervisor starts for this backend, once for every front end (None: each
    front end serves it alone, or its ranks are started elsewhere). Every DeepInfer engine, even a single one,
    lives in a rank worker: N front ends cannot each build an engine on the same devices."""
    if isinstance(config, ReferenceBackendConfig) and config.uses_workers and not config.worker_endpoints:
        from backends.reference.backend import reference_worker_plan

        return reference_worker_plan(config)
    if isinstance(config, DeepInferBackendConfig) and not config.worker_endpoints:
        from backends.deepinfer.backend import deepinfer_worker_plan

        return deepinfer_worker_plan(config)
    return None


def rank_host(config: BackendConfig, run_dir: str) -> RankHosting | None:
    """The rank workers of ``config`` hosted once for several front-end processes (not started yet; their ipc
    endpoints under ``run_dir``), or None when the backend has none to host (``hosted_worker_plan``)."""
    plan = hosted_worker_plan(config)
    if plan is None:
        return None
    from backends.workers.host import RankHost

    return RankHost(config.name, plan, run_dir)


def rank_node(config: BackendConfig, nodes: int, node: int, host: str, master_addr: str | None) -> RankNodeRun:
    """Node ``node`` of ``nodes``'s share of the ranks a backend lists in ``worker_endpoints``, bound on ``host``,
    checked before any rank starts (the key files there and readable). Raises ValueError naming what is wrong."""
    from backends.workers.keys import keys_for
    from backends.workers.node import NodeShare, RankNode, bind_address

    if not isinstance(config, ReferenceBackendConfig | DeepInferBackendConfig) or not config.worker_endpoints:
        raise ValueError(f"backend {config.name!r} lists no worker_endpoints: the gateway starts its ranks itself")
    endpoints = config.worker_endpoints
    share = NodeShare(len(endpoints), nodes, node)
    plan = node_worker_plan(config, share.ranks, master_addr)
    bound = [bind_address(endpoints[rank], host) for rank in share.ranks]
    for address in bound:
        keys = keys_for(address, config.rank_keys)
        if keys is not None:
            keys.rank_public()
    return RankNode(config.name, plan, share.ranks, bound)


def create_rank_keys(directory: Path) -> list[Path]:
    """Writes the rank plane's key pairs (``deepinfer-gateway rank-keys``); raises ``RankKeysError`` or OSError."""
    from backends.workers.keys import create_keys

    return create_keys(directory)


TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
"""The variable by which Hugging Face's tokenizers (and deepseek-recipe, which bundles them) choose their thread
pool; read at every encode."""


def prepare_serving_process() -> None:
    """What a process serving backends sets once before it takes requests:

    - multi-MiB bodies and prompts go back to the OS when freed (``backends/heap.py``);
    - prompts are encoded on the calling thread (``TOKENIZERS_PARALLELISM=false`` unless the environment says
      otherwise). Hugging Face's batch encode (a completion's prompt) and deepseek-recipe's ``encode`` otherwise
      hand the work to a thread pool whose threads spin before they sleep: with the library's encode that cost the
      front end about 2.4 µs of CPU per streamed token on two cores (150 µs per 64-token request, more than the
      encode itself), for prompts encoded in tens of µs. Long prompts are spread over the preparation threads
      instead (``PromptPreparer``).
    """
    from backends.heap import cap_mmap_threshold

    cap_mmap_threshold()
    os.environ.setdefault(TOKENIZERS_PARALLELISM, "false")

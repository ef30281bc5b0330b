"""The ``deepinfer`` backend kind: the generic engine backend over DeepSeek's DeepInfer engine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from backends.config import DeepInferBackendConfig
from backends.deepinfer.engine import DeepInferEngine
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.deepseek.images import ImageResolution
from backends.engine.backend import DrivenEngines, EngineBackend

if TYPE_CHECKING:
    from backends.workers.launch import WorkerPlan


def build_deepinfer_backend(config: DeepInferBackendConfig) -> DrivenEngines[Any]:
    """Nothing of DeepInfer is imported here: the engine is built on the driver thread when the backend starts
    (or, with ``data_parallel_size`` > 1 or ``worker_endpoints``, in one worker process per DP rank)."""
    if config.uses_workers:
        return _build_data_parallel_backend(config)

    def construct() -> DeepInferEngine:  # runs on the engine thread
        from backends.deepinfer.startup import start_engine

        return start_engine(config)

    return EngineBackend(
        config.name,
        "deepinfer",
        construct,
        DeepSeekV41ChatTemplate(default_thinking=config.default_thinking),
        prepare_threads=config.prepare_threads,
        images=ImageResolution(config.images, config.image_urls),
    )


def deepinfer_worker_plan(config: DeepInferBackendConfig, environ: Mapping[str, str] = os.environ) -> WorkerPlan:
    """Where the DP ranks of ``config`` run and how each builds its engine: spawned here (by the gateway, or once by
    the front-end supervisor for all its front ends) with the devices of ``environ`` split per rank, or reached at
    ``worker_endpoints``. With one rank there is nothing to keep in step: the engine simply lives in a worker."""
    from backends.deepinfer.ranks import RankEnvironment, data_parallel_options
    from backends.workers.launch import WorkerPlan

    remote = list(config.worker_endpoints)
    options = config.model_dump(mode="json") if remote else data_parallel_options(config, environ)
    return WorkerPlan(
        size=config.data_parallel_size,
        factory="backends.deepinfer.ranks:build_rank_engine",
        options=options,
        lockstep=config.data_parallel_size > 1,
        remote_endpoints=remote,
        rank_env=None if remote else RankEnvironment(options),
        keys=config.rank_keys,
    )


def _build_data_parallel_backend(config: DeepInferBackendConfig) -> DrivenEngines[Any]:
    """N DeepInfer ranks in lockstep worker processes behind the dispatcher (docs/data-parallel.md)."""
    from backends.deepinfer.ranks import load_tokenizer
    from backends.workers.backend import DataParallelBackend

    return DataParallelBackend(
        config.name,
        "deepinfer",
        deepinfer_worker_plan(config),
        lambda: load_tokenizer(config),
        DeepSeekV41ChatTemplate(default_thinking=config.default_thinking),
        prepare_threads=config.prepare_threads,
        images=ImageResolution(config.images, config.image_urls),
    )

"""The ``deepinfer`` backend kind: the generic engine backend over DeepSeek's DeepInfer engine."""

from __future__ import annotations

import os

from backends.config import DeepInferBackendConfig
from backends.deepinfer.engine import DeepInferEngine
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import EngineBackend


def build_deepinfer_backend(config: DeepInferBackendConfig) -> EngineBackend:
    """Nothing of DeepInfer is imported here: the engine is built on the driver thread when the backend starts
    (or, with ``data_parallel_size`` > 1, in one worker process per DP rank)."""
    if config.data_parallel_size > 1:
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
    )


def _build_data_parallel_backend(config: DeepInferBackendConfig) -> EngineBackend:
    """N DeepInfer ranks in lockstep worker processes behind the dispatcher (docs/data-parallel.md)."""
    from backends.deepinfer.ranks import RankEnvironment, data_parallel_options, load_tokenizer
    from backends.workers.backend import DataParallelBackend
    from backends.workers.driver import WorkerPlan

    options = data_parallel_options(config, os.environ)  # the gateway's devices, split per rank by rank_env
    plan = WorkerPlan(
        size=config.data_parallel_size,
        factory="backends.deepinfer.ranks:build_rank_engine",
        options=options,
        lockstep=True,
        rank_env=RankEnvironment(options),
    )
    return DataParallelBackend(
        config.name,
        "deepinfer",
        plan,
        lambda: load_tokenizer(config),
        DeepSeekV41ChatTemplate(default_thinking=config.default_thinking),
        prepare_threads=config.prepare_threads,
    )

"""The ``reference`` backend kind: the generic engine backend over the CPU reference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.config import ReferenceBackendConfig
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.deepseek.images import ImageResolution
from backends.engine.backend import DrivenEngines, EngineBackend

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from backends.reference.engine import ReferenceEngine
    from backends.workers.launch import WorkerPlan
    from backends.workers.spec import RankContext, RankEngine


def build_reference_backend(config: ReferenceBackendConfig) -> DrivenEngines[Any]:
    if config.uses_workers:
        return _build_data_parallel_backend(config)

    def construct() -> ReferenceEngine:  # runs on the engine thread
        return _make_engine(config, config.seed)

    return EngineBackend(
        config.name,
        "reference",
        construct,
        DeepSeekV41ChatTemplate(default_thinking=config.default_thinking),
        prepare_threads=config.prepare_threads,
        images=ImageResolution(config.images, config.image_urls),
    )


def _make_engine(config: ReferenceBackendConfig, seed: int | None) -> ReferenceEngine:
    from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs

    return ReferenceEngine.from_engine_args(
        ReferenceEngineArgs(
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            seed=seed,
            prefill_seconds_per_token=config.timing.prefill_seconds_per_token,
            decode_seconds_per_step=config.timing.decode_seconds_per_step,
            tokens_per_step=config.timing.tokens_per_step,
            prefix_cache_tokens=config.prefix_cache_tokens,
            prefix_cache_block_size=config.prefix_cache_block_size,
        )
    )


# ---- data parallelism: N reference engines in worker processes (docs/data-parallel.md) ---------------------------


def reference_worker_plan(config: ReferenceBackendConfig) -> WorkerPlan:
    """Where the ranks of ``config`` run and how each builds its engine (also used by the front-end supervisor,
    which starts them once for all its front-end processes)."""
    from backends.workers.launch import WorkerPlan

    return WorkerPlan(
        size=config.data_parallel_size,
        factory="backends.reference.backend:build_rank_engine",
        options=config.model_dump(mode="json"),
        lockstep=config.lockstep,
        transport=config.worker_transport,
        remote_endpoints=list(config.worker_endpoints),
        keys=config.rank_keys,
    )


def _build_data_parallel_backend(config: ReferenceBackendConfig) -> DrivenEngines[Any]:
    from backends.workers.backend import DataParallelBackend

    return DataParallelBackend(
        config.name,
        "reference",
        reference_worker_plan(config),
        load_tokenizer,
        DeepSeekV41ChatTemplate(default_thinking=config.default_thinking),
        prepare_threads=config.prepare_threads,
        images=ImageResolution(config.images, config.image_urls),
    )


def load_tokenizer() -> Tokenizer:
    """The gateway encodes prompts and decodes outputs itself: the same tokenizer the workers load (cached)."""
    from backends.reference.artifacts import load_or_build

    return load_or_build().tokenizer


def build_rank_engine(context: RankContext) -> RankEngine:
    """Runs in a worker process: one rank's engine; in lockstep, wrapped to imitate DeepInfer's collectives."""
    from backends.workers.collective import LockstepEngine, SimulatedGroup
    from backends.workers.spec import RankEngine

    config = ReferenceBackendConfig.model_validate(context.options)
    # Each rank draws unseeded requests' seeds from its own stream, or ranks would repeat each other's samples.
    seed = None if config.seed is None else config.seed * 1_000_003 + context.rank
    engine = _make_engine(config, seed)
    if not context.lockstep:
        return RankEngine(engine)
    assert context.collective_endpoint is not None
    group = SimulatedGroup(context.rank, context.size, context.collective_endpoint)
    return RankEngine(LockstepEngine(engine, group), group)

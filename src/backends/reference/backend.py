"""The ``reference`` backend kind: the generic engine backend over the CPU reference engine."""

from __future__ import annotations

from backends.config import ReferenceBackendConfig
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import EngineBackend


def build_reference_backend(config: ReferenceBackendConfig) -> EngineBackend:
    def construct():  # type: ignore[no-untyped-def]  # runs on the engine thread
        from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs

        return ReferenceEngine.from_engine_args(
            ReferenceEngineArgs(
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                seed=config.seed,
                prefill_seconds_per_token=config.timing.prefill_seconds_per_token,
                decode_seconds_per_step=config.timing.decode_seconds_per_step,
                tokens_per_step=config.timing.tokens_per_step,
            )
        )

    return EngineBackend(config.name, "reference", construct, DeepSeekV41ChatTemplate())

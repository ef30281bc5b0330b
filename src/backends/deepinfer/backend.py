"""The ``deepinfer`` backend kind: the generic engine backend over DeepSeek's DeepInfer engine."""

from __future__ import annotations

from backends.config import DeepInferBackendConfig
from backends.deepinfer.engine import DeepInferEngine
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import EngineBackend


def build_deepinfer_backend(config: DeepInferBackendConfig) -> EngineBackend:
    """Nothing of DeepInfer is imported here: the engine is built on the driver thread when the backend starts."""

    def construct() -> DeepInferEngine:  # runs on the engine thread
        from backends.deepinfer.startup import start_engine

        return start_engine(config)

    return EngineBackend(
        config.name, "deepinfer", construct, DeepSeekV41ChatTemplate(default_thinking=config.default_thinking)
    )

"""CPU reference engine: DeepInfer's ``LLMEngine`` API over a small n-gram model built from local text.

The gateway's embedded default (no GPU needed) and the engine the serving code is tested on.
"""

from __future__ import annotations

from .artifacts import ReferenceArtifacts, default_cache_dir, load_or_build
from .engine import ReferenceEngine, ReferenceEngineArgs
from .sampling_params import SamplingParams
from .sequence import ReferenceSequence, SequenceStatus
from .tokenizer import SpecialTokenIds, special_token_ids

__all__ = [
    "ReferenceArtifacts",
    "ReferenceEngine",
    "ReferenceEngineArgs",
    "ReferenceSequence",
    "SamplingParams",
    "SequenceStatus",
    "SpecialTokenIds",
    "default_cache_dir",
    "load_or_build",
    "special_token_ids",
]

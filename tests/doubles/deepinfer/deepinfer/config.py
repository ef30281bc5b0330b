"""TEST DOUBLE of ``deepinfer.config``: the engine configs, their defaults and their checks.

As in DeepInfer, ``SchedulerConfig``'s prefill-interval defaults are read from the environment when this module is
imported, so variables set after ``import deepinfer.engine...`` come too late.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer._double import BLOCK_SIZE
from deepinfer.engine.engine_type import EngineType


def _runtime_max_model_len(max_model_len: int) -> int:
    nextn = envs.DEEPINFER_USE_NEXTN_DECODE
    scheduler_overhead = nextn + (nextn + 1 if envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING else 0)
    return max_model_len + scheduler_overhead + nextn


def _max_num_batched_tokens(max_model_len: int, max_num_batched_tokens: int | None, max_num_seqs: int) -> int:
    decoding = max_num_seqs * (1 + envs.DEEPINFER_USE_NEXTN_DECODE)
    if max_num_batched_tokens is not None:
        assert max_num_batched_tokens >= decoding
        return max_num_batched_tokens
    return max(max_model_len, 4096, decoding)


class ModelConfig:
    """Reads ``<model>/config.json`` (a local directory; DeepInfer never downloads)."""

    def __init__(
        self,
        model: str,
        tokenizer: str,
        trust_remote_code: bool,
        load_format: str,
        seed: int,
        max_num_seqs: int,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        ignore_len: int = -1,
        served_model_name: str = "deepinfer-model",
        engine_type: EngineType = EngineType.NORMAL,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.trust_remote_code = trust_remote_code
        assert load_format.lower() in ("auto", "dummy")
        self.load_format = load_format.lower()
        self.seed = seed
        self.revision = revision
        self.tokenizer_revision = tokenizer_revision
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len if max_model_len is not None else 4096
        self.runtime_max_model_len = _runtime_max_model_len(self.max_model_len)
        self.max_num_batched_tokens = _max_num_batched_tokens(self.max_model_len, max_num_batched_tokens, max_num_seqs)
        self.served_model_name = served_model_name
        self.engine_type = engine_type
        hf: dict[str, Any] = json.loads((Path(model) / "config.json").read_text())
        assert "vl_aligner" in hf, "Only multimodal HF models with vl_aligner are supported"
        self.hf_config = hf

    def get_vocab_size(self) -> int:
        return int(self.hf_config["text_config"]["vocab_size"])


class CacheConfig:
    def __init__(self, block_size: int, gpu_memory_utilization: float, lookahead_tokens: int) -> None:
        if gpu_memory_utilization > 1.0:
            raise ValueError(f"GPU memory utilization must be less than 1.0. Got {gpu_memory_utilization}.")
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.lookahead_tokens = lookahead_tokens
        self.num_gpu_blocks: int | None = None  # set by memory profiling during engine construction


class ParallelConfig:
    def __init__(
        self,
        data_parallel_size: int,
        context_parallel_size: int,
        expert_parallel_size: int,
        engram_parallel_size: int,
        engine_rank: int,
        engine_group_rank: int,
        engine_type: EngineType = EngineType.NORMAL,
    ) -> None:
        if data_parallel_size == 0:
            data_parallel_size = max(1, expert_parallel_size // context_parallel_size)
        self.data_parallel_size = data_parallel_size
        self.context_parallel_size = context_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.engine_rank = engine_rank
        self.data_parallel_rank = engine_rank % data_parallel_size
        self.engine_group_rank = engine_group_rank
        self.engine_type = engine_type
        self.engram_parallel_size = engram_parallel_size or context_parallel_size * data_parallel_size
        self.world_size = max(context_parallel_size * data_parallel_size, self.engram_parallel_size)
        assert (context_parallel_size * data_parallel_size) % expert_parallel_size == 0
        assert 0 <= engine_rank < self.world_size // context_parallel_size


class SchedulerConfig:
    def __init__(
        self,
        max_num_batched_tokens: int | None,
        max_num_seqs: int,
        max_model_len: int,
        stop_preempted_request: bool = False,
        chunked_prefill: bool = False,
        prefill_attempt_interval: int = envs.DEEPINFER_PREFILL_ATTEMPT_INTERVAL,  # read at import, as in DeepInfer
        prefill_any_attempt_interval: int = envs.DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL,
    ) -> None:
        self.max_num_batched_tokens = _max_num_batched_tokens(max_model_len, max_num_batched_tokens, max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.runtime_max_model_len = _runtime_max_model_len(max_model_len)
        self.stop_preempted_request = stop_preempted_request
        self.chunked_prefill = chunked_prefill
        self.prefill_attempt_interval = prefill_attempt_interval
        self.prefill_any_attempt_interval = prefill_any_attempt_interval
        if not chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len})."
            )
        if prefill_attempt_interval < 1 or prefill_any_attempt_interval < 1:
            raise ValueError("prefill attempt intervals should be >= 1")

    @property
    def prompt_limit(self) -> int:
        return self.max_model_len if self.chunked_prefill else min(self.max_model_len, self.max_num_batched_tokens)


__all__ = ["BLOCK_SIZE", "CacheConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig"]

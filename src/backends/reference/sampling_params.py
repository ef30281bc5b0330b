"""DeepInfer's ``SamplingParams`` contract: the same keywords, defaults, normalization and validation errors.

The gateway builds a dict of these keywords for any engine; the reference engine must accept and reject exactly
what DeepInfer would, so a request that works here works on the GPU engine too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from .sampler import GREEDY_TEMPERATURE

_INT32_MAX = 2**31 - 1
_UINT64_MASK = 0xFFFFFFFFFFFFFFFF
MAX_TOP_LOGPROBS = 1000


class SamplingParams:
    """Per-request sampling settings; construct with keywords, as DeepInfer's engine does from a dict."""

    __slots__ = (
        "eos_id",
        "first_n_token_no_eos",
        "golden_token_ids",
        "ignore_eos",
        "max_tokens",
        "prompt_logprobs",
        "seq_seed",
        "so_args",
        "temperature",
        "top_k",
        "top_logprobs",
        "top_p",
    )

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        ignore_eos: bool = False,
        max_tokens: int = 16,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        first_n_token_no_eos: int = 0,
        eos_id: int = 0,
        so_args: dict[str, Any] | None = None,
        golden_token_ids: Sequence[int] | None = None,
        seq_seed: int | None = None,
    ) -> None:
        del logprobs  # accepted for compatibility only, as in DeepInfer
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.ignore_eos = ignore_eos
        self.max_tokens = 1 if max_tokens == 0 else max_tokens
        self.prompt_logprobs = prompt_logprobs
        self.top_logprobs = top_logprobs
        self.first_n_token_no_eos = first_n_token_no_eos
        self.eos_id = eos_id
        self.so_args = so_args
        self.golden_token_ids = golden_token_ids
        if seq_seed is None:
            seq_seed = random.getrandbits(64)
        elif not isinstance(seq_seed, int):
            raise TypeError()
        self.seq_seed = seq_seed & _UINT64_MASK
        self._verify()
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = GREEDY_TEMPERATURE
            self.top_p = 1.0
            self.top_k = -1

    def _verify(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not math.isfinite(self.temperature):  # stricter than DeepInfer: inf or nan would poison the sampler
            raise ValueError(f"temperature must be finite, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k != -1 and not 1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}.")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @classmethod
    def from_request(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """What ``add_request`` does: ``None`` is ``{}``, ``None`` values are dropped, unknown keys raise."""
        if isinstance(params, SamplingParams):
            return params
        if params is None:
            return cls()
        return cls(**{key: value for key, value in params.items() if value is not None})

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in sorted(self.__slots__))
        return f"SamplingParams({fields})"

"""TEST DOUBLE of ``deepinfer.sampling_params``: DeepInfer's keywords, defaults, normalization and validation."""

from __future__ import annotations

import random
from typing import Any

SAMPLING_EPS = 1e-5
_INT32_MAX = 2**31 - 1


class SamplingParams:
    """Same constructor as DeepInfer's; unknown keywords raise ``TypeError``, bad values ``ValueError``."""

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
        golden_token_ids: list[int] | None = None,
        seq_seed: int | None = None,
    ) -> None:
        del logprobs
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.ignore_eos = ignore_eos
        self.max_tokens = 1 if max_tokens == 0 else max_tokens
        self.prompt_logprobs = prompt_logprobs
        self.top_logprobs = top_logprobs
        self.seq_seed = self._make_seed(seq_seed)
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            self.temperature = SAMPLING_EPS
            self.top_p = 1.0
            self.top_k = -1
        self.first_n_token_no_eos = first_n_token_no_eos
        self.eos_id = eos_id
        self.so_args = so_args
        self.golden_token_ids = golden_token_ids

    @staticmethod
    def _make_seed(seed: int | None) -> int:
        if seed is None:
            return random.getrandbits(64)
        if isinstance(seed, int):
            return seed & 0xFFFF_FFFF_FFFF_FFFF
        raise TypeError()

    def _verify_args(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0 or self.top_k > _INT32_MAX:
            raise ValueError(f"top_k must be -1 (disable), or between 1 and int32 max, got {self.top_k}.")
        if self.max_tokens < 1 or self.max_tokens > _INT32_MAX:
            raise ValueError(f"max_tokens must be >= 1 and in range of int32, got {self.max_tokens}.")
        if self.top_logprobs < 0 or self.top_logprobs > 1000:
            raise ValueError(f"top_logprobs must be in [0, 1000], got {self.top_logprobs}.")

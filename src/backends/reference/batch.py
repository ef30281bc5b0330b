"""The running batch of the reference engine: its requests in admission order and their decode state as arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import sampler
from .sequence import ReferenceSequence

MAX_TOP_LOGPROBS = 20
"""Top-logprob lists are capped at this length (OpenAI's maximum); DeepInfer accepts up to 1000."""


class DecodeArrays:
    """Per-request decode state of the running requests as parallel numpy arrays, in admission order."""

    FIELDS = (
        "prev2",
        "prev1",
        "region",
        "key",
        "pos",
        "prompt_len",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "greedy",
        "ignore_eos",
        "no_eos_first",
        "n_top",
        "golden",
        "so",
    )
    prev2: np.ndarray
    prev1: np.ndarray
    region: np.ndarray
    key: np.ndarray
    pos: np.ndarray
    prompt_len: np.ndarray
    max_tokens: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    greedy: np.ndarray
    ignore_eos: np.ndarray
    no_eos_first: np.ndarray
    n_top: np.ndarray
    golden: np.ndarray
    so: np.ndarray

    def __init__(self) -> None:
        self._assign(self.rows([], width=1))

    @staticmethod
    def rows(seqs: Sequence[ReferenceSequence], width: int) -> dict[str, np.ndarray]:
        """The rows of newly admitted ``seqs`` (``width``: the model's candidates per row, the top-k cap)."""
        params = [s.params for s in seqs]
        seeds = np.array([p.seq_seed for p in params], dtype=np.uint64)
        return {
            "prev2": np.array([s.prev2 for s in seqs], dtype=np.int64),
            "prev1": np.array([s.prev1 for s in seqs], dtype=np.int64),
            "region": np.array([s.region for s in seqs], dtype=np.int64),
            "key": sampler.stream_keys(seeds),
            "pos": np.zeros(len(seqs), dtype=np.int64),
            "prompt_len": np.array([s.prompt_len for s in seqs], dtype=np.int64),
            "max_tokens": np.array([p.max_tokens for p in params], dtype=np.int64),
            "temperature": np.array([p.temperature for p in params], dtype=np.float64),
            "top_k": np.array([width if p.top_k == -1 else min(p.top_k, width) for p in params], dtype=np.int64),
            "top_p": np.array([p.top_p for p in params], dtype=np.float64),
            "greedy": np.array([p.greedy for p in params], dtype=bool),
            "ignore_eos": np.array([bool(p.ignore_eos) for p in params], dtype=bool),
            "no_eos_first": np.array([p.first_n_token_no_eos == 1 for p in params], dtype=bool),
            "n_top": np.array([min(p.top_logprobs, MAX_TOP_LOGPROBS) for p in params], dtype=np.int64),
            "golden": np.array([bool(p.golden_token_ids) for p in params], dtype=bool),
            "so": np.array([s.so is not None for s in seqs], dtype=bool),
        }

    def _assign(self, arrays: dict[str, np.ndarray]) -> None:
        for name in self.FIELDS:
            setattr(self, name, arrays[name])

    def extend(self, arrays: dict[str, np.ndarray]) -> None:
        self._assign({name: np.concatenate((getattr(self, name), arrays[name])) for name in self.FIELDS})

    def keep(self, mask: np.ndarray) -> None:
        self._assign({name: getattr(self, name)[mask] for name in self.FIELDS})


class RunningBatch:
    """The running requests in admission order: sequences, ids and prompt lengths, with their ``DecodeArrays``."""

    def __init__(self) -> None:
        self.seqs: list[ReferenceSequence] = []
        self.request_ids: list[str] = []
        self.prompt_lens: list[int] = []
        self.arrays = DecodeArrays()
        self.num_so = 0  # running requests with so_args: zero keeps sampling on its plain path

    def admit(self, seqs: Sequence[ReferenceSequence], width: int) -> None:
        """Append newly admitted requests (``width``: the model's candidates per row, the top-k cap)."""
        self.arrays.extend(DecodeArrays.rows(seqs, width))
        self.seqs.extend(seqs)
        self.request_ids.extend(s.request_id for s in seqs)
        self.prompt_lens.extend(s.prompt_len for s in seqs)
        self.num_so = int(np.count_nonzero(self.arrays.so))

    def retain(self, keep: np.ndarray) -> None:
        """Keep the rows where ``keep`` is true, in order."""
        self.arrays.keep(keep)
        flags = keep.tolist()
        self.seqs = [s for s, k in zip(self.seqs, flags, strict=True) if k]
        self.request_ids = [s.request_id for s in self.seqs]
        self.prompt_lens = [s.prompt_len for s in self.seqs]
        self.num_so = int(np.count_nonzero(self.arrays.so))

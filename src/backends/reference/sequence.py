"""A reference-engine request's state: DeepInfer's ``SequenceStatus`` and what ``add_request`` returns."""

from __future__ import annotations

import numpy as np

from backends.engine.protocol import EngineOutput

from .model import NO_TOKEN
from .sampling_params import SamplingParams
from .structured_state import StructuredState

SYNTHETIC_LOGPROB = 1.0
"""DeepInfer's ``token_logprobs`` on outputs whose token was never sampled."""


class SequenceStatus:
    """DeepInfer's ``SequenceStatus`` values for the states the reference engine uses."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_SO_FAILED = 8


class ReferenceSequence:
    """What ``add_request`` returns (DeepInfer returns its C++ ``Sequence``): identity, status, lengths."""

    __slots__ = (
        "block_keys",
        "last_prompt_token",
        "params",
        "prev1",
        "prev2",
        "prompt_len",
        "prompt_logprobs",
        "region",
        "request_id",
        "so",
        "so_error",
        "status",
        "user_id",
    )

    def __init__(self, user_id: str, request_id: str, params: SamplingParams, prompt: np.ndarray, region: int) -> None:
        self.user_id = user_id
        self.request_id = request_id
        self.params = params
        self.so: StructuredState | None = None  # structured-output state, if the request has so_args
        self.so_error = ""  # why it ended as FINISHED_SO_FAILED (compile error, or grammar error mid-generation)
        self.prompt_len = int(prompt.size)
        self.last_prompt_token = int(prompt[-1])
        self.prev1 = self.last_prompt_token
        self.prev2 = int(prompt[-2]) if prompt.size > 1 else NO_TOKEN
        self.region = region
        self.status = SequenceStatus.WAITING
        self.prompt_logprobs: list[float] | None = None  # sent on the first output, if the request asked
        self.block_keys: list[bytes] = []  # its prompt's prefix-cache keys until admitted (with a prefix cache)

    def synthetic_output(self, reason: str) -> EngineOutput:
        """The single output of a request that never ran: its last prompt token, never to be detokenized."""
        return EngineOutput(
            self.request_id, self.last_prompt_token, True, reason, 1, self.prompt_len, SYNTHETIC_LOGPROB, (), ()
        )

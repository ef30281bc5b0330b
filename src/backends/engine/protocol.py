"""The seam between the engine driver and any engine with DeepInfer's ``LLMEngine`` API.

DeepInfer's ``step()`` returns raw pointers that die at the next step; its binding copies them into
``EngineOutput`` records. The reference engine produces these records directly. Everything above this
module sees only plain records, so the CPU reference engine exercises the exact code that drives DeepInfer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
from tokenizers import Tokenizer

EOS_TOKEN_ID = 1
"""DeepInfer's tokenizer policy pins EOS to id 1 (BOS 0, PAD 2)."""


class EngineOutput(NamedTuple):
    """One emitted token of one request, read out of the engine before its next ``step()``."""

    request_id: str
    token_id: int
    finished: bool
    finish_reason: str  # "" unless finished: stop, length, abort, prompt_length_exceeded, ...
    num_output_tokens: int
    prompt_len: int
    token_logprob: float
    top_logprobs: Sequence[float]
    top_token_ids: Sequence[int]
    prompt_logprobs: Sequence[float] | None = None
    """On a request's first output, when it asked for ``prompt_logprobs``: element ``i`` is the logprob of prompt
    token ``i + 1`` given the tokens before it (DeepInfer's ``get_prompt_logprobs``, ``prompt_len - 1`` floats)."""
    num_cached_tokens: int = 0
    """On a request's first output: the prompt tokens the engine found already computed when it scheduled the
    prompt (its prefix-cache hits, DeepInfer's ``Sequence.num_cached_tokens`` then); 0 on later outputs."""


class FinishReason:
    """DeepInfer's ``finish_reason`` strings (``csrc/engine/sequence.hpp``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PROMPT_LENGTH_EXCEEDED = "prompt_length_exceeded"
    INSUFFICIENT_SYSTEM_RESOURCE = "insufficient_system_resource"
    SO_FAILED = "xgrammar runtime errors or timeout"
    VE_FAILED = "ve_error"


class MetricSample(NamedTuple):
    """One engine statistic for ``/metrics``, offered by an engine's optional ``metric_samples()`` method.

    Read at scrape time from another thread, so an engine keeps these as plain numbers it updates once per step.
    The gateway exports ``gateway_<name>`` labelled with the backend, knowing nothing of the engine behind it.
    """

    name: str
    kind: str  # "gauge" or "counter"
    documentation: str
    value: float


class EngineView(Protocol):
    """What the request path reads of an engine: its tokenizer and limits. An in-process ``Engine`` is one; the
    data-parallel driver's view of its ranks (``backends.workers.ranks.RankedEngineView``) is another."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...


@runtime_checkable
class Engine(Protocol):
    """DeepInfer's ``LLMEngine`` surface, with ``step()`` returning plain records.

    Every method is called from the driver's one engine thread, which also constructs the engine.
    ``sampling_params`` follows DeepInfer's ``SamplingParams`` keyword contract (temperature, top_p, top_k,
    ignore_eos, max_tokens, top_logprobs, prompt_logprobs, seq_seed, so_args, ...); unknown keys raise ``TypeError``.
    """

    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer  # a ``tokenizers.Tokenizer``; DeepInfer's binding passes ``backend_tokenizer``

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> object | None: ...

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def step(self) -> Sequence[EngineOutput]: ...

    def flush_inflight_reqs(self) -> Sequence[EngineOutput]: ...

    def close(self) -> None: ...


@runtime_checkable
class StructuredOutputCompiler(Protocol):
    """An engine that compiles ``so_args`` grammars on any thread, ahead of ``add_request``.

    The backend calls ``compile_so_args`` on its preparation pool (never on the engine thread) and passes what it
    returns as ``so_args``: still the same mapping, now carrying the compiled grammar, so that ``add_request`` on
    the engine thread only copies it. DeepInfer compiles on its own thread pool and needs no such method.
    """

    def compile_so_args(self, so_args: Mapping[str, Any]) -> Mapping[str, Any]: ...

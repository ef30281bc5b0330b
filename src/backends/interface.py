"""The one interface every backend speaks: a ``GenerateRequest`` in, an async iterator of events out.

Events are plain slotted records: the hot path builds one per engine step per choice, never a pydantic model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

PromptKind = Literal["chat", "text", "tokens"]


@dataclass(slots=True)
class SamplingOptions:
    """Sampling as the client asked for it; ``None`` means the backend's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True)
class GenerateRequest:
    """A normalized generation request, independent of the HTTP API it came from.

    Exactly one of ``messages`` (chat), ``prompt`` (text) or ``prompt_token_ids`` is set.
    """

    request_id: str
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    n: int = 1
    echo: bool = False
    deadline: float | None = None  # time.monotonic() value after which the work is abandoned
    user: str | None = None

    @property
    def kind(self) -> PromptKind:
        if self.messages is not None:
            return "chat"
        return "text" if self.prompt is not None else "tokens"


class TopLogprob(NamedTuple):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(NamedTuple):
    """Logprob of one emitted token and its top alternatives, with text as the client sees it."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TopLogprob]


class Delta(NamedTuple):
    """New output of one choice since the previous event (usually one engine step's worth)."""

    index: int
    text: str
    logprobs: Sequence[TokenLogprob] | None = None


class Finish(NamedTuple):
    """The choice is complete. ``reason`` is an OpenAI finish reason: stop, length, tool_calls."""

    index: int
    reason: str


class Usage(NamedTuple):
    """Token accounting, sent once after every choice finished."""

    prompt_tokens: int
    completion_tokens: int


class PromptEcho(NamedTuple):
    """The prompt text and its token logprobs, for ``echo`` on the completions API."""

    index: int
    text: str
    logprobs: Sequence[TokenLogprob | None] | None = None


Event = Delta | Finish | Usage | PromptEcho


class Backend(Protocol):
    """What the gateway needs from any backend kind."""

    name: str
    kind: str

    async def start(self) -> None:
        """Bring the backend up; may take long (model build, engine construction)."""

    async def stop(self) -> None:
        """Release everything; in-flight requests end with an error event."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for the readiness probe and operators."""
        ...

    def max_model_len(self) -> int | None:
        """Context window, when the backend knows it."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Stream events for ``request``. Closing the iterator early aborts the work."""
        ...

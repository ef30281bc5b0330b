"""The one interface every backend speaks: a ``GenerateRequest`` in, an async iterator of events out.

Events are plain slotted records: the hot path builds one per engine step per choice, never a pydantic model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from backends.cancellation import TaskCancel as TaskCancel  # the one cancellation ledger
from backends.deadlines import Deadline as Deadline  # the one deadline mechanism
from backends.deadlines import DeadlineExpired as DeadlineExpired
from backends.streams import NOT_OPENED as NOT_OPENED  # a wrapper's batches before its inner stream opened
from backends.streams import BatchStream as BatchStream  # a stream read a batch at a time
from backends.streams import EventStream as EventStream  # what generate returns
from backends.streams import batches_of as batches_of  # any stream's batches
from backends.streams import conforms as conforms  # a cached isinstance for runtime-checkable protocols
from backends.streams import interleave as interleave  # part of the surface: the gateway merges choices and prompts
from backends.streams import never_notifies as never_notifies  # notify of a stream that cannot
from backends.streams import notify_of as notify_of  # a stream's synchronous wake-up, if it has one

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

PromptKind = Literal["chat", "text", "tokens"]

SERVICE_TIERS: tuple[str, ...] = ("priority", "default", "flex", "batch")
"""The service tiers, best first. A request of a better tier is admitted before any of a worse one. ``batch`` is
internal: the Batch API's work, below ``flex``; the online routes never accept it from a client."""

CLIENT_SERVICE_TIERS: tuple[str, ...] = SERVICE_TIERS[:-1]
"""The tiers a client may name on the online routes (``auto`` aside, which means the key's default)."""


@dataclass(slots=True)
class SamplingOptions:
    """Sampling as the client asked for it; ``None`` means the backend's default.

    Not every backend honours every field: each backend checks with ``reject_unsupported`` and answers a field it
    cannot honour, set to a non-default value, with a 400 naming it.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    fit_context: bool = False
    """``max_tokens`` is only a ceiling: when the prompt leaves less room in the context, generate up to the
    context's end instead of refusing the request (the Messages API's behaviour; chat refuses)."""


SAMPLING_DEFAULTS = SamplingOptions()

TraceValue = str | bool | int | float


class TraceStage(NamedTuple):
    """A finished piece of one backend call (preparing the prompt, waiting for a slot), for the call's trace.

    Times are ``time.time_ns()`` readings, so a stage can be measured on any thread and reported afterwards.
    """

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, TraceValue] | None = None
    error: str | None = None  # why the stage failed, when it did


class CallTrace(Protocol):
    """The gateway's trace of one backend call, on the requests of traced calls only (``GenerateRequest.trace``).

    Backends tell it where the call's time went without knowing the tracing library; nothing here is per token.
    """

    def headers(self) -> dict[str, str]:
        """W3C trace-context headers (``traceparent``, ``tracestate``) for an HTTP request the call sends upstream."""
        ...

    def record(self, stage: TraceStage) -> None:
        """A finished stage of the call (a child span of the call's)."""

    def annotate(self, name: str, value: TraceValue) -> None:
        """An attribute of the call, e.g. the data-parallel rank that served it."""


@contextmanager
def traced_stage(trace: CallTrace, name: str, attributes: dict[str, TraceValue]) -> Iterator[int]:
    """Records the ``with`` block as the stage ``name`` of the call's trace (it yields the start, a
    ``time.time_ns()``). ``attributes`` may be filled in within the block; a failure is named by the backend
    error's message, or the exception's type (a cancellation)."""
    from backends.errors import BackendError

    started = time.time_ns()
    error: str | None = None
    try:
        yield started
    except BackendError as exc:
        error = exc.message
        raise
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        trace.record(TraceStage(name, started, time.time_ns(), attributes, error))


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
    max_buffered_tokens: int | None = None  # most output a backend holds for a client that does not read; None: no cap
    user: str | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI tools list
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # OpenAI response_format (text | json_object | json_schema ...)
    thinking: bool | None = None  # None: the backend's documented default
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    trace: CallTrace | None = None  # set by the gateway on the requests of a traced backend call
    service_tier: str = "default"  # one of SERVICE_TIERS: which tier's queue admits the request
    priority: int = 0  # vLLM's extension: within a tier, lower is admitted first
    tenant: str | None = None  # the label of the API key it came with: whose share of the backend it uses
    log: dict[str, object] | None = None  # the request's access-log line: admission adds its tier and queue wait

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


class ToolCallDelta(NamedTuple):
    """A piece of one tool call; ``id`` and ``name`` come with the call's first piece, arguments may follow."""

    index: int  # type: ignore[assignment]  # position of the call within its choice; public, shadows tuple.index
    id: str | None
    name: str | None
    arguments: str


class Delta(NamedTuple):
    """New output of one choice since the previous event (usually one engine step's worth)."""

    index: int  # type: ignore[assignment]  # the choice's index (public, on the wire); shadows tuple.index
    text: str
    logprobs: Sequence[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: Sequence[ToolCallDelta] | None = None
    tokens: int = 0
    """Output tokens generated for the choice since its previous delta (text a stop string or a parser held back
    is counted with the delta that finally carries it). What a request that ends before its ``Usage`` is charged
    by; 0 from a backend that cannot tell."""
    prompt_tokens: int = 0
    """On the first delta of a ``generate`` stream: the prompt tokens the backend processed (what its ``Usage``
    will report), so a request that ends before its ``Usage`` is charged its exact prompt; 0 elsewhere, and from a
    backend that cannot tell before its usage (the gateway then charges its estimate)."""


class Finish(NamedTuple):
    """The choice is complete. ``reason`` is an OpenAI finish reason: stop, length, tool_calls.

    ``logprobs`` (when logprobs were asked for) covers the end-of-sequence token that ended the choice: it adds no
    text but is counted in ``completion_tokens``, and the legacy completions format lists it. ``matched_stop`` is
    the stop string that ended the choice, when one did (reason ``stop``).
    """

    index: int  # type: ignore[assignment]  # the choice's index (public, on the wire); shadows tuple.index
    reason: str
    logprobs: Sequence[TokenLogprob] | None = None
    matched_stop: str | None = None


class Usage(NamedTuple):
    """Token accounting, sent once after every choice finished."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None = None  # of the completion tokens, those spent reasoning (when known)
    cached_tokens: int = 0
    """Of the prompt tokens, those the backend found in its prefix cache, as the engine or node reported them;
    0 when it reports none (never an estimate)."""


class PromptToken(NamedTuple):
    """One prompt token as scored by the model: ``logprob`` is None for the first (nothing precedes it).

    ``offset`` is where the token starts in the echoed prompt text, in characters.
    """

    token: str
    logprob: float | None
    offset: int


class PromptEcho(NamedTuple):
    """The prompt text, and with ``logprobs`` its tokens' logprobs, for ``echo`` on the completions API."""

    index: int  # type: ignore[assignment]  # the choice's index (public, on the wire); shadows tuple.index
    text: str
    logprobs: Sequence[PromptToken] | None = None


Event = Delta | Finish | Usage | PromptEcho

REQUEST_FEATURES = ("tools", "tool_choice", "response_format", "thinking", "reasoning_effort", "chat_template_kwargs")
IMAGES_FEATURE = "images"
"""The feature of backends that take image parts in user messages (a backend's ``supported_features`` names it)."""

IMAGE_TOKENS_BOUND = 1024
"""The most prompt tokens one image can take (V4.1's image token rule tops out at 994): budgets and flow control
reserve this much per image before the image is decoded, and settle with the exact count."""


def image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(request path, part) of every image part of chat messages, in prompt order.

    An image part is OpenAI's ``{"type": "image_url", "image_url": {"url", "detail"}}``; one translated from
    another API carries ``path``, its location in the client's request (``input[0].content[1]``).
    """
    for position, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                path = part.get("path")
                yield (path if isinstance(path, str) else f"messages[{position}].content[{index}]"), part


def has_image_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    return next(image_parts(messages), None) is not None


def reject_unsupported(request: GenerateRequest, *, sampling: frozenset[str], features: frozenset[str]) -> None:
    """Raises a 400-class error naming the first field set to a value the backend cannot honour.

    ``sampling`` names the ``SamplingOptions`` fields the backend honours beyond the basics; ``features`` the
    request-level features (``REQUEST_FEATURES``) it supports. Default values are always accepted.
    """
    from backends.errors import InvalidRequestError

    options = request.sampling
    for name in ("min_tokens", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
        value = getattr(options, name)
        if name not in sampling and value and value != getattr(SAMPLING_DEFAULTS, name):
            raise InvalidRequestError(f"{name} is not supported by this backend; leave it at its default", param=name)
    if "skip_special_tokens" not in sampling and not options.skip_special_tokens:
        raise InvalidRequestError(
            "skip_special_tokens=false is not supported by this backend", param="skip_special_tokens"
        )
    if "tools" not in features and request.messages:
        for position, message in enumerate(request.messages):
            if message.get("role") == "tool" or message.get("tool_calls"):
                raise InvalidRequestError(
                    "tool messages and tool calls are not supported by this backend yet", param=f"messages[{position}]"
                )
    if IMAGES_FEATURE not in features and request.messages:
        for path, _ in image_parts(request.messages):
            raise InvalidRequestError(
                "image inputs are not supported by this model; send text", param=path, code="unsupported_value"
            )
    for name in REQUEST_FEATURES:
        value = getattr(request, name)
        if name in features or value in (None, [], {}):
            continue
        if name == "tool_choice" and value in ("none", "auto"):
            continue
        if name == "response_format" and value.get("type", "text") == "text":
            continue
        if name == "thinking" and value is False:
            continue
        if name == "reasoning_effort" and value in ("none", "minimal"):
            continue
        raise InvalidRequestError(f"{name} is not supported by this backend yet", param=name)


class Backend(Protocol):
    """What the gateway needs from any backend kind."""

    @property
    def name(self) -> str:
        """The backend's configured name: model routing and metric labels use it."""
        ...

    @property
    def kind(self) -> str:
        """Which backend kind this is (reference, deepinfer, lmdeploy, ...)."""
        ...

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

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        """Stream events for ``request``. Closing the generator early (``aclose``) aborts the work."""
        ...


class TokenizerInfo(NamedTuple):
    """What a client-side tokenizer needs to mirror the backend's: its special tokens and limits."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    vocab_size: int
    max_model_len: int | None


@runtime_checkable
class TokenizingBackend(Protocol):
    """Optional capability of a backend: the exact token ids its model sees, for the tokenizer endpoints.

    ``tokenize`` encodes a request's prompt (chat messages through the backend's chat encoder, or text) the way
    ``generate`` would; ``add_special_tokens`` None means what ``generate`` does (BOS for text, none added to the
    chat encoding, which writes its own).
    """

    def tokenizer_info(self) -> TokenizerInfo: ...

    async def tokenize(self, request: GenerateRequest, *, add_special_tokens: bool | None = None) -> list[int]: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry, as the tokenizer spells it (byte-level characters for DeepSeek's)."""
        ...


@runtime_checkable
class PromptCountingBackend(Protocol):
    """Optional capability of a backend that does not expose its tokenizer but can count a prompt without generating
    (an upstream's own count): the prompt tokens ``generate`` would report, or None where its count would not be
    exact for this request."""

    async def count_prompt_tokens(self, request: GenerateRequest) -> int | None: ...


@runtime_checkable
class FingerprintedBackend(Protocol):
    """Optional capability of a backend: the ``system_fingerprint`` its responses carry (engine, version, ...)."""

    @property
    def fingerprint(self) -> str | None: ...


class EngineCounters(Protocol):
    """An engine driver's running totals, read at scrape time (single writer, no locks)."""

    @property
    def steps(self) -> int: ...

    @property
    def tokens(self) -> int: ...

    @property
    def busy_seconds(self) -> float: ...

    @property
    def engine_seconds(self) -> float: ...

    @property
    def backpressure_seconds(self) -> float: ...


class EngineDriverView(Protocol):
    """What ``/metrics`` reads of the driver that steps a backend's engine."""

    @property
    def stats(self) -> EngineCounters: ...

    @property
    def in_flight(self) -> int: ...


@runtime_checkable
class DrivenBackend(Protocol):
    """Optional capability of a backend: an engine driver whose counters ``/metrics`` exports."""

    @property
    def driver(self) -> EngineDriverView: ...


@runtime_checkable
class MetricSamplesBackend(Protocol):
    """Optional capability of a backend: engine statistics as ``(name, kind, help, value)``, exported as
    ``gateway_<name>{backend}`` without the gateway knowing the engine behind them."""

    def metric_samples(self) -> Sequence[tuple[str, str, str, float]]: ...


@runtime_checkable
class MetricFamiliesBackend(Protocol):
    """Optional capability of a backend: metric families with labels of its own (per upstream node, per rank)."""

    def metric_families(self) -> list[Metric]: ...


class RankHosting(Protocol):
    """A backend's rank workers, run once by the front-end supervisor for every front end: started, watched
    (``descriptors`` end when a rank exits) and relaunched by the supervisor's loop, stopped after the last front
    end; the front ends reach them at ``endpoints``."""

    endpoints: list[str]

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def descriptors(self) -> list[int]: ...

    def timeout(self, now: float) -> float | None: ...

    def on_exited(self, ready: Sequence[object], now: float) -> None: ...

    def relaunch_due(self, now: float) -> None: ...


class RankNodeRun(Protocol):
    """This node's share of a backend's rank workers (``deepinfer-gateway ranks``), ready to run."""

    def run(self) -> int:
        """Serves until the group stops; the process's exit status."""
        ...

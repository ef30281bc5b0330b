"""Prompt preparation on a worker pool: chat rendering, tokenizing and grammar compiling, off the event loop.

A chat message may be megabytes long (the body limit is 8 MiB): rendering it, tokenizing it (seconds of CPU for a
few MiB) and compiling its output grammar (a large JSON schema takes a few hundred milliseconds) must neither stall
the event loop, which also answers ``/health``, nor the engine thread, which steps every other request. Each
request's preparation therefore runs as one job on a small thread pool (``prepare_threads`` in the backend's
config). Tokenizing uses ``encode_batch_fast``: it releases the GIL while the Rust tokenizer works (``encode``
keeps it for the whole 25 s of a 7 MiB prompt), and its encodings carry no offsets, so freeing one (which holds
the GIL) takes 30 ms instead of a second. Grammars are compiled by engines that offer ``StructuredOutputCompiler``
and handed to ``add_request`` ready. For a traced request (``GenerateRequest.trace``) the job's parts are timed on
the pool thread and reported to the trace from the event loop, as one stage ``engine.prepare_prompt`` (submission
to result) whose attributes split it: the wait for a pool thread, rendering, tokenizing, compiling (one span
rather than four: the SDK's cost is per span).

A chat's images (``ChatPrompt.image_sources``) are resolved on the same job by the backend's ``ImageResolver``
(decoding and resizing an image takes milliseconds to seconds of CPU), and the prompt's length for the context
check is its ids plus the tokens the images add beyond their placeholders.

A small prompt with nothing to compile or decode (``INLINE_PROMPT_CHARS``, no tools, no ``response_format``, no
images, not traced) is prepared on the event loop instead: rendering and tokenizing a few hundred characters takes
tens of microseconds, less than the hand-off to a pool thread and back (a queue, two thread wake-ups, the loop's
self-pipe), which was about a tenth of the front end's CPU per request on short chats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
from tokenizers import Encoding, Tokenizer

from backends.engine.detokenizer import TokenTable
from backends.engine.protocol import EngineView, StructuredOutputCompiler
from backends.errors import ContextLengthExceededError, InvalidRequestError
from backends.heap import release_free_heap
from backends.interface import (
    GenerateRequest,
    SamplingOptions,
    ToolCallDelta,
    TraceValue,
    has_image_parts,
    traced_stage,
)

DEFAULT_PREPARE_THREADS = 2
INLINE_PROMPT_CHARS = 2048
"""Prompts with at most this many characters (the strings of all messages together) and no grammar are prepared
on the event loop; anything larger goes to the pool."""
TRIM_AFTER_CHARS = 1 << 20
"""After preparing a prompt this long, return the tokenizer's freed heap to the OS (glibc keeps it otherwise)."""


class OutputParser(Protocol):
    """The model family's parser of one choice's text into reasoning, content and tool calls, fed per step.

    It also matches the request's stop sequences, where the model family says they apply (DeepSeek: in the answer
    only); ``matched_stop`` says when one ended the choice.
    """

    @property
    def in_reasoning(self) -> bool: ...

    @property
    def called(self) -> bool: ...

    @property
    def matched_stop(self) -> str | None: ...

    @property
    def drops_leading_newlines(self) -> bool:
        """Whether the reply starts a new channel whose leading newlines are dropped (and not counted)."""
        ...

    def push(self, text: str) -> tuple[str, str, Sequence[ToolCallDelta]]: ...

    def finish(self) -> tuple[str, str, Sequence[ToolCallDelta]]: ...


class OutputParserFactory(Protocol):
    """Makes one choice's ``OutputParser``, given the request's stop sequences."""

    def __call__(self, *, stops: Sequence[str]) -> OutputParser: ...


class ChatPrompt(NamedTuple):
    """A rendered chat request: prompt text plus what decoding and output parsing need for it."""

    text: str
    parser: OutputParserFactory | None = None  # one parser per choice
    so_args: dict[str, Any] | None = None  # DeepInfer structured-output arguments
    so_param: str | None = None  # the request field that asked for constrained decoding, for error messages
    reasoning_end_token: int | None = None  # id of the token that closes reasoning, to count reasoning tokens
    token_ids: Sequence[int] | None = None  # the prompt's ids, when the template encodes it (client text stays text)
    image_sources: Sequence[object] = ()  # the images of its placeholders, in prompt order, for an ImageResolver


class ChatTemplate(Protocol):
    """Renders chat messages into the model family's prompt (DeepSeek V4.1 for DeepInfer).

    ``features`` (optional) names the ``REQUEST_FEATURES`` it implements; the backend honours them. ``render``
    runs on the preparation pool, several requests at once: it must be thread-safe.
    ``output_markers``: the tags its output parser reads; the detokenizer keeps them even if they are special.
    """

    output_markers: Sequence[str]

    def render(self, request: GenerateRequest, tokenizer: Tokenizer) -> ChatPrompt: ...


@runtime_checkable
class TokenizerBoundTemplate(Protocol):
    """A chat template with costly per-tokenizer state (DeepSeek's: the library's encoding of the engine's
    ``tokenizer.json``), built once when the backend starts rather than by its first request."""

    def bind_tokenizer(self, tokenizer: Tokenizer) -> None: ...


@runtime_checkable
class SamplingPolicyTemplate(Protocol):
    """A chat template whose model family serves some requests with sampling of its own, whatever they ask, and
    without an error (DeepSeek in thinking mode: temperature 1.0, no presence or frequency penalty)."""

    def served_sampling(self, request: GenerateRequest) -> SamplingOptions: ...


class PromptImages(Protocol):
    """A prompt's images as the engine takes them."""

    @property
    def extra_tokens(self) -> int:
        """Prompt tokens the images take beyond one placeholder token each (the engine expands placeholders)."""
        ...

    def multi_modal_data(self) -> dict[str, Any]:
        """``add_request``'s ``multi_modal_data``: image bytes and sizes, one per placeholder in prompt order."""
        ...


class ImageResolver(Protocol):
    """Turns a chat's image sources into the engine's images; runs on the preparation pool (thread-safe), and
    raises ``InvalidRequestError`` (or its 413 kind) naming the image a limit or a broken image refuses."""

    def resolve(self, sources: Sequence[Any]) -> PromptImages: ...


class PreparedPrompt(NamedTuple):
    """What the engine needs from a request's prompt, ready to add."""

    ids: np.ndarray  # int32, 1-D, C-contiguous: what DeepInfer's add_request takes
    chat: ChatPrompt | None
    so_args: Mapping[str, Any] | None  # the chat's so_args, compiled when the engine offers it
    images: PromptImages | None = None  # the chat's images, resolved

    @property
    def token_count(self) -> int:
        """The prompt's tokens as the engine counts them: each image placeholder expanded."""
        return len(self.ids) + (self.images.extra_tokens if self.images is not None else 0)


class PromptPreparer:
    """Prepares prompts for one engine backend on its own thread pool."""

    def __init__(
        self,
        chat_template: ChatTemplate,
        *,
        threads: int = DEFAULT_PREPARE_THREADS,
        name: str,
        images: ImageResolver | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError("prepare_threads must be at least 1")
        self._template = chat_template
        self._images = images
        self._threads = threads
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._engine: EngineView | None = None
        self._max_token_bytes: int | None = None

    def start(self, engine: EngineView, table: TokenTable) -> None:
        """Binds the engine whose tokenizer and limits apply and starts the pool."""
        self._engine = engine
        self._max_token_bytes = _max_token_bytes(engine.tokenizer, table)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix=f"prepare-{self._name}")

    def stop(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, request: GenerateRequest) -> PreparedPrompt:
        """Renders, tokenizes and checks the prompt, and compiles its grammar, on the pool."""
        executor = self._executor
        engine = self._engine
        assert executor is not None and engine is not None, "PromptPreparer.start() was not called"
        trace = request.trace
        if trace is None and _small(request):
            return self._prepare(request, engine, None, 0)
        loop = asyncio.get_running_loop()
        if trace is None:
            return await loop.run_in_executor(executor, self._prepare, request, engine, None, 0)
        parts: dict[str, TraceValue] = {}
        with traced_stage(trace, "engine.prepare_prompt", parts) as started:
            prompt = await loop.run_in_executor(executor, self._prepare, request, engine, parts, started)
            parts["gateway.prompt.tokens"] = len(prompt.ids)
        return prompt

    # ---- pool threads ----------------------------------------------------------------------------------------

    def _prepare(
        self, request: GenerateRequest, engine: EngineView, parts: dict[str, TraceValue] | None, submitted: int
    ) -> PreparedPrompt:
        """The preparation job; a traced one (``parts``) also notes how long each part took, from ``submitted``
        (when the event loop handed it to the pool) on."""
        if request.prompt_token_ids is not None:
            if len(request.prompt_token_ids) > engine.max_model_len:
                raise _too_long(engine.max_model_len, f"has {len(request.prompt_token_ids)} tokens", "prompt")
            ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
            vocab = engine.vocab_size
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_token_id"
                )
            if ids.size == 0:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return PreparedPrompt(np.ascontiguousarray(ids, dtype=np.int32), None, None)
        chat: ChatPrompt | None = None
        mark = _part(parts, "gateway.prompt.queue_s", submitted) if parts is not None else 0  # the wait for a thread
        if request.messages is not None:
            chat = self._template.render(request, engine.tokenizer)
            text = chat.text
            add_special_tokens = False  # the chat template writes BOS itself
            if parts is not None:
                mark = _part(parts, "gateway.prompt.render_s", mark)
        else:
            text = request.prompt or ""
            add_special_tokens = True
        if parts is not None:
            parts["gateway.prompt.chars"] = len(text)
        images = self._resolve_images(chat)
        if images is not None and parts is not None:
            mark = _part(parts, "gateway.prompt.images_s", mark)
        if chat is not None and chat.token_ids is not None:
            ids = _checked_ids(chat.token_ids, engine.max_model_len, images.extra_tokens if images is not None else 0)
        else:
            ids = self._tokenize(text, add_special_tokens, engine, param="messages" if chat is not None else "prompt")
        if parts is not None:
            mark = _part(parts, "gateway.prompt.tokenize_s", mark)
        so_args: Mapping[str, Any] | None = chat.so_args if chat is not None else None
        if so_args is not None and isinstance(engine, StructuredOutputCompiler):
            so_args = engine.compile_so_args(so_args)
            if parts is not None:
                _part(parts, "gateway.prompt.compile_s", mark)
        return PreparedPrompt(ids, chat, so_args, images)

    def _resolve_images(self, chat: ChatPrompt | None) -> PromptImages | None:
        """The chat's images, decoded and resized here on the pool (never on the event loop)."""
        if chat is None or not chat.image_sources:
            return None
        if self._images is None:
            raise InvalidRequestError("images are not supported by this model", param="messages")
        return self._images.resolve(chat.image_sources)

    def _tokenize(self, text: str, add_special_tokens: bool, engine: EngineView, *, param: str) -> np.ndarray:
        limit = engine.max_model_len
        if self._max_token_bytes and len(text) > limit * self._max_token_bytes:
            # Every token covers at most max_token_bytes bytes of the text, and a character is at least one byte:
            # this prompt cannot fit, and tokenizing it would cost seconds of CPU for nothing.
            raise _too_long(limit, f"is {len(text)} characters long, which is more than {limit} tokens", param)
        encoding: Encoding | None = None
        try:
            encoding = engine.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
            count = len(encoding)
            if count > limit:
                raise _too_long(limit, f"has {count} tokens", param)
            if count == 0:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return np.array(encoding.ids, dtype=np.int32)
        finally:
            if len(text) >= TRIM_AFTER_CHARS:
                encoding = None
                release_free_heap()


def _checked_ids(token_ids: Sequence[int], limit: int, image_tokens: int = 0) -> np.ndarray:
    """A chat template's own token ids, checked against the context length (with the tokens its images take
    beyond their placeholders)."""
    count = len(token_ids) + image_tokens
    if count > limit:
        images = f", {image_tokens} of them beyond the images' placeholders" if image_tokens else ""
        raise _too_long(limit, f"has {count} tokens{images}", "messages")
    return np.array(token_ids, dtype=np.int32)


def _small(request: GenerateRequest) -> bool:
    """Whether the request's prompt is cheap enough to prepare on the event loop (``INLINE_PROMPT_CHARS``)."""
    if request.tools or request.response_format is not None:
        return False  # a grammar to compile
    if request.messages is not None and has_image_parts(request.messages):
        return False  # images to decode
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids) <= INLINE_PROMPT_CHARS
    if request.prompt is not None:
        return len(request.prompt) <= INLINE_PROMPT_CHARS
    return _chars_left(request.messages, INLINE_PROMPT_CHARS) >= 0


def _chars_left(value: object, budget: int) -> int:
    """``budget`` less the characters of every string in ``value`` (JSON-like); negative once it ran out."""
    if isinstance(value, str):
        return budget - len(value)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return budget
    for item in value:
        budget = _chars_left(item, budget)
        if budget < 0:
            break
    return budget


def _part(parts: dict[str, TraceValue], name: str, started: int) -> int:
    """Records how long the part of a traced preparation that began at ``started`` took, in seconds; returns now."""
    now = time.time_ns()
    parts[name] = (now - started) / 1e9
    return now


def _too_long(limit: int, prompt: str, param: str) -> ContextLengthExceededError:
    return ContextLengthExceededError(
        f"This model's maximum context length is {limit} tokens. However, your prompt {prompt}.", param=param
    )


def _max_token_bytes(tokenizer: Tokenizer, table: TokenTable) -> int | None:
    """The most bytes of text one token can stand for, when that is known (byte-level BPE without a normalizer,
    which could shrink the text); None otherwise."""
    if not table.byte_level or tokenizer.normalizer is not None:
        return None
    return max((len(raw) for raw in table.raw_bytes_of), default=0) or None

"""A backend over an in-process engine: prompt encoding, engine driver, and per-choice output processing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from backends.engine.detokenizer import IncrementalDetokenizer, TokenTable
from backends.engine.driver import EngineDriver
from backends.engine.protocol import EOS_TOKEN_ID, Engine, EngineOutput, FinishReason
from backends.engine.stop import StopMatcher
from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
    UpstreamError,
)
from backends.interface import (
    Delta,
    Event,
    Finish,
    GenerateRequest,
    PromptEcho,
    TokenLogprob,
    TopLogprob,
    Usage,
    reject_unsupported,
)

LONG_PROMPT_CHARS = 16_384
"""Prompts longer than this are tokenized on a worker thread so the event loop never stalls on them."""


class ChatTemplate(Protocol):
    """Renders chat messages into the model family's prompt text (DeepSeek V4.1 for DeepInfer)."""

    def render(self, request: GenerateRequest) -> str: ...


class EngineBackend:
    """Serves requests from one in-process engine driven by an ``EngineDriver``."""

    supported_sampling: frozenset[str] = frozenset()
    supported_features: frozenset[str] = frozenset()

    def __init__(
        self,
        name: str,
        kind: str,
        engine_factory: Callable[[], Engine],
        chat_template: ChatTemplate,
    ) -> None:
        self.name = name
        self.kind = kind
        self.driver = EngineDriver(engine_factory, name=name)
        self._chat_template = chat_template
        self._table: TokenTable | None = None
        self._ids = itertools.count()
        self._started = False
        self._starting = False

    async def start(self) -> None:
        self._starting = True
        try:
            await self.driver.start()
            engine = self.driver.engine
            assert engine is not None
            self._table = await asyncio.to_thread(TokenTable, engine.tokenizer)
            self._started = True
        finally:
            self._starting = False

    async def stop(self) -> None:
        self._started = False
        await self.driver.stop()

    def readiness(self) -> tuple[bool, str]:
        if self.driver.failure:
            return False, self.driver.failure
        if not self._started:
            return False, "starting" if self._starting else "not started"
        return True, "ready"

    def max_model_len(self) -> int | None:
        engine = self.driver.engine
        return engine.max_model_len if engine is not None else None

    @property
    def in_flight(self) -> int:
        return self.driver.in_flight

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if not self._started or not self.driver.alive:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}")
        table = self._table
        engine = self.driver.engine
        assert table is not None and engine is not None
        reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
        prompt_ids = await self._prompt_ids(request, engine)
        max_tokens = _resolve_max_tokens(request, len(prompt_ids), engine.max_model_len)
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
            "top_logprobs": sampling.top_logprobs if sampling.logprobs else 0,
        }
        prompt_array = np.asarray(prompt_ids, dtype=np.int32)
        queue: asyncio.Queue[tuple[int, Sequence[EngineOutput] | BackendError]] = asyncio.Queue()
        put = queue.put_nowait

        def sink(index: int, item: Sequence[EngineOutput] | BackendError) -> None:
            put((index, item))

        base = f"{request.request_id}#{next(self._ids)}"
        engine_ids = [f"{base}.{i}" for i in range(request.n)]
        choices = [
            _Choice(index, table, table.new_detokenizer(), sampling.stop, sampling.logprobs)
            for index in range(request.n)
        ]
        live = set(engine_ids)
        try:
            for index, engine_id in enumerate(engine_ids):
                seed = None if sampling.seed is None else sampling.seed + index
                self.driver.add(engine_id, {**params, "seq_seed": seed}, prompt_array, sink, index, request.user or "")
            if request.echo:
                echo_text = request.prompt if request.prompt is not None else table.tokenizer.decode(prompt_ids)
                for index in range(request.n):
                    yield PromptEcho(index, echo_text)
            remaining = request.n
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BackendError):
                    live.discard(engine_ids[index])
                    raise item
                choice = choices[index]
                delta, finish = choice.consume(item)
                if finish is not None:
                    remaining -= 1
                    if not item[-1].finished:  # a stop string ended it: the engine still runs it
                        self.driver.abort([engine_ids[index]])
                    live.discard(engine_ids[index])
                if delta is not None:
                    yield delta
                if finish is not None:
                    yield Finish(index, finish)
            yield Usage(len(prompt_ids), sum(c.tokens for c in choices))
        finally:
            if live:
                self.driver.abort(list(live))

    async def _prompt_ids(self, request: GenerateRequest, engine: Engine) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            vocab = engine.vocab_size
            if any(i < 0 or i >= vocab for i in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_token_id"
                )
            return ids
        if request.messages is not None:
            text = self._chat_template.render(request)
            add_special_tokens = False  # the chat template writes BOS itself
        else:
            text = request.prompt or ""
            add_special_tokens = True
        tokenizer = engine.tokenizer
        if len(text) > LONG_PROMPT_CHARS:
            encoding = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
        else:
            encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids


def _resolve_max_tokens(request: GenerateRequest, prompt_len: int, max_model_len: int) -> int:
    """The output bound sent to the engine: the client's, or the rest of the context (never DeepInfer's 16)."""
    room = max_model_len - prompt_len
    asked = request.sampling.max_tokens
    if asked is None:
        if room < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for any output.",
                param="messages" if request.messages is not None else "prompt",
            )
        return room
    if asked > room:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return asked


class _Choice:
    """Turns one engine request's outputs into text deltas: detokenize, match stops, format logprobs."""

    __slots__ = ("_detok", "_logprobs", "_stop", "_table", "index", "tokens")

    def __init__(
        self, index: int, table: TokenTable, detok: IncrementalDetokenizer, stops: list[str], logprobs: bool
    ) -> None:
        self.index = index
        self._table = table
        self._detok = detok
        self._stop = StopMatcher(stops) if stops else None
        self._logprobs = logprobs
        self.tokens = 0

    def consume(self, outputs: Sequence[EngineOutput]) -> tuple[Delta | None, str | None]:
        """Returns the delta to emit (if any) and the OpenAI finish reason once the choice is done."""
        last = outputs[-1]
        finish: str | None = None
        if last.finished:
            finish = _finish_reason(last)
            real = list(outputs) if last.token_id != EOS_TOKEN_ID and finish == "length" else list(outputs[:-1])
        else:
            real = outputs
        self.tokens = last.num_output_tokens
        text = self._detok.push([o.token_id for o in real]) if real else ""
        if finish is not None:
            text += self._detok.flush()
        if self._stop is not None:
            text, matched = self._stop.push(text)
            if matched:
                finish = "stop"
            elif finish is not None:
                text += self._stop.flush()
        logprobs = self._format_logprobs(real) if self._logprobs and real else None
        if not text and logprobs is None:
            return None, finish
        return Delta(self.index, text, logprobs), finish

    def _format_logprobs(self, outputs: Sequence[EngineOutput]) -> list[TokenLogprob]:
        text_of, bytes_of = self._table.text_of, self._table.raw_bytes_of
        return [
            TokenLogprob(
                text_of[o.token_id],
                list(bytes_of[o.token_id]),
                o.token_logprob,
                [
                    TopLogprob(text_of[t], list(bytes_of[t]), lp)
                    for t, lp in zip(o.top_token_ids, o.top_logprobs, strict=False)
                ],
            )
            for o in outputs
        ]


def _finish_reason(output: EngineOutput) -> str:
    """Maps DeepInfer's finish reasons to OpenAI's, raising for those that are errors to the client."""
    reason = output.finish_reason
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason
    if reason == FinishReason.PROMPT_LENGTH_EXCEEDED:
        raise ContextLengthExceededError(
            f"the prompt ({output.prompt_len} tokens) does not fit the engine's context window", param="messages"
        )
    if reason == FinishReason.INSUFFICIENT_SYSTEM_RESOURCE:
        raise OverloadedError(
            "the engine stopped the request to free KV cache (insufficient_system_resource); retry later",
            retry_after=1.0,
            code="insufficient_system_resource",
        )
    raise UpstreamError(f"the engine ended the request with finish_reason {reason!r}")

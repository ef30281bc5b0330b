"""A backend over an in-process engine: prompt encoding, engine driver, and per-choice output processing."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import itertools
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from backends.engine.buffer import OutputBuffer
from backends.engine.choice import Choice, finish_reason
from backends.engine.detokenizer import TokenTable
from backends.engine.driver import EngineDriver
from backends.engine.prompts import (
    DEFAULT_PREPARE_THREADS,
    ChatPrompt,
    ChatTemplate,
    PromptPreparer,
)
from backends.engine.prompts import (
    OutputParser as OutputParser,  # re-exported: the parser protocol was defined beside the choice code
)
from backends.engine.protocol import EOS_TOKEN_ID, Engine, MetricSample
from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    SlowClientError,
    UnavailableError,
    UpstreamError,
)
from backends.interface import (
    Event,
    Finish,
    GenerateRequest,
    PromptEcho,
    PromptToken,
    TokenizerInfo,
    Usage,
    reject_unsupported,
)

try:
    _GATEWAY_VERSION = importlib.metadata.version("deepinfer-gateway")
except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
    _GATEWAY_VERSION = "dev"

LONG_PROMPT_CHARS = 16_384
"""Prompts longer than this are tokenized on a worker thread so the event loop never stalls on them."""
LONG_DECODE_TOKENS = 4_096
"""Token lists longer than this are decoded on a worker thread, for the same reason."""
INLINE_PROMPT_TOKENS = 512
"""Echoed prompts with logprobs longer than this are formatted on a worker thread (microseconds per token)."""
BOS_TOKEN_ID, PAD_TOKEN_ID = 0, 2
"""DeepInfer's tokenizer policy: BOS 0, EOS 1 (``EOS_TOKEN_ID``), PAD 2."""


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
        *,
        prepare_threads: int = DEFAULT_PREPARE_THREADS,
    ) -> None:
        self.name = name
        self.kind = kind
        self.supported_features = type(self).supported_features | getattr(chat_template, "features", frozenset())
        self.driver = EngineDriver(engine_factory, name=name)
        self._chat_template = chat_template
        self._prompts = PromptPreparer(chat_template, threads=prepare_threads, name=name)
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
            self._table = await asyncio.to_thread(
                functools.partial(TokenTable, engine.tokenizer, markers=self._chat_template.output_markers)
            )
            self._prompts.start(engine, self._table)
            self._started = True
        finally:
            self._starting = False

    async def stop(self) -> None:
        self._started = False
        self._prompts.stop()
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

    @property
    def fingerprint(self) -> str | None:
        """The engine's ``system_fingerprint`` (engine, version, batch invariance), else the kind and version."""
        return getattr(self.driver.engine, "fingerprint", None) or f"fp_{self.kind}-{_GATEWAY_VERSION}"

    def metric_samples(self) -> Sequence[MetricSample]:
        """Engine statistics for ``/metrics``, if the engine offers them (read at scrape time)."""
        samples = getattr(self.driver.engine, "metric_samples", None)
        return samples() if samples is not None else ()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        if not self._started or not self.driver.alive:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}")
        table = self._table
        engine = self.driver.engine
        assert table is not None and engine is not None
        reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
        prompt = await self._prompts.prepare(request)
        prompt_ids, chat = prompt.ids, prompt.chat
        max_tokens = _resolve_max_tokens(request, len(prompt_ids), engine.max_model_len)
        sampling = request.sampling
        score_only = max_tokens == 0  # echo with max_tokens 0: score the prompt, generate nothing
        scoring = request.echo and sampling.logprobs
        params: dict[str, Any] = {
            "max_tokens": max(1, max_tokens),  # engines generate at least one token; score_only drops it
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
            "top_logprobs": sampling.top_logprobs if sampling.logprobs else 0,
        }
        if prompt.so_args is not None:
            params["so_args"] = prompt.so_args
        if scoring:
            params["prompt_logprobs"] = True
        prompt_array = np.asarray(prompt_ids, dtype=np.int32)
        base = f"{request.request_id}#{next(self._ids)}"
        engine_ids = [f"{base}.{i}" for i in range(request.n)]
        live = set(engine_ids)
        outputs = OutputBuffer(request.max_buffered_tokens, lambda: self.driver.abort(list(live)))
        sink = outputs.put
        make_parser = chat.parser if chat is not None else None
        reasoning_end = chat.reasoning_end_token if chat is not None else None
        choices = [
            Choice(
                index,
                table,
                table.new_detokenizer(),
                sampling.stop,
                sampling.logprobs,
                make_parser() if make_parser is not None else None,
                reasoning_end,
            )
            for index in range(request.n)
        ]
        try:
            for index, engine_id in enumerate(engine_ids):
                seed = None if sampling.seed is None else sampling.seed + index
                rank = self.driver.add(
                    engine_id, {**params, "seq_seed": seed}, prompt_array, sink, index, request.user or ""
                )
                if rank is not None and request.trace is not None:
                    request.trace.annotate("gateway.dp.rank", rank)  # a request's choices share one rank
            echo_text = ""
            if request.echo:
                echo_text = (
                    request.prompt if request.prompt is not None else table.tokenizer.decode(prompt_ids.tolist())
                )
                if not scoring:  # the echo needs nothing from the engine: send it at once
                    for index in range(request.n):
                        yield PromptEcho(index, echo_text)
            remaining = request.n
            echoed = [not scoring] * request.n
            prompt_unreported = True
            pop, arrival = outputs.pop, outputs.arrival
            while remaining:
                entry = pop()
                if entry is None:
                    await arrival()
                    continue
                index, item = entry
                if isinstance(item, BackendError):
                    live.discard(engine_ids[index])
                    raise _blame_constraint(item, chat)
                choice = choices[index]
                if not echoed[index]:  # the prompt step's output carries the prompt logprobs
                    echoed[index] = True
                    if item[0].finished:
                        finish_reason(item[0])  # raises for a request that ended in error before it ran
                    scores = item[0].prompt_logprobs
                    if len(prompt_ids) > INLINE_PROMPT_TOKENS:
                        entries = await asyncio.to_thread(_prompt_tokens, table, prompt_ids, scores)
                    else:
                        entries = _prompt_tokens(table, prompt_ids, scores)
                    yield PromptEcho(index, echo_text, entries)
                if score_only:
                    remaining -= 1
                    if item[-1].finished:
                        finish_reason(item[-1])  # raises for a request the engine refused (context, resources)
                    else:
                        self.driver.abort([engine_ids[index]])
                    live.discard(engine_ids[index])
                    yield Finish(index, "length")
                    continue
                try:
                    delta, finish = choice.consume(item)
                except InvalidRequestError as exc:
                    raise _blame_constraint(exc, chat) from None
                if finish is not None:
                    remaining -= 1
                    if not item[-1].finished:  # a stop string ended it: the engine still runs it
                        self.driver.abort([engine_ids[index]])
                    live.discard(engine_ids[index])
                if delta is not None:
                    if prompt_unreported:  # a request cut short before its usage is charged its exact prompt
                        prompt_unreported = False
                        delta = delta._replace(prompt_tokens=len(prompt_ids))
                    yield delta
                if finish is not None:
                    yield Finish(index, finish, choice.end_logprobs, choice.matched_stop)
            if score_only:
                yield Usage(len(prompt_ids), 0, None)
                return
            reasoning = sum(c.reasoning_tokens for c in choices) if make_parser is not None else None
            yield Usage(len(prompt_ids), sum(c.tokens for c in choices), reasoning)
        finally:
            if live:
                self.driver.abort(list(live))

    # ---- TokenizingBackend ------------------------------------------------------------------------------------

    def _ready_engine(self) -> Engine:
        engine = self.driver.engine
        if not self._started or engine is None:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}")
        return engine

    def tokenizer_info(self) -> TokenizerInfo:
        engine = self._ready_engine()
        tokenizer = engine.tokenizer
        return TokenizerInfo(
            tokenizer_class=f"tokenizers.{type(tokenizer).__name__}",
            bos_token=tokenizer.id_to_token(BOS_TOKEN_ID),
            eos_token=tokenizer.id_to_token(EOS_TOKEN_ID),
            pad_token=tokenizer.id_to_token(PAD_TOKEN_ID),
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
        )

    async def tokenize(self, request: GenerateRequest, *, add_special_tokens: bool | None = None) -> list[int]:
        engine = self._ready_engine()
        if request.messages is not None:
            reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
            text = self._chat_template.render(request, engine.tokenizer).text
            default = False  # the chat encoding writes BOS itself
        else:
            text = request.prompt or ""
            default = True
        special = default if add_special_tokens is None else add_special_tokens
        return await _encode(engine.tokenizer, text, add_special_tokens=special)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        engine = self._ready_engine()
        vocab = engine.vocab_size
        if any(i < 0 or i >= vocab for i in token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens", code="invalid_token_id")
        ids = list(token_ids)
        decode = engine.tokenizer.decode
        if len(ids) > LONG_DECODE_TOKENS:
            return await asyncio.to_thread(decode, ids, skip_special_tokens=False)
        return decode(ids, skip_special_tokens=False)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        id_to_token = self._ready_engine().tokenizer.id_to_token
        return [id_to_token(i) or "" for i in token_ids]


async def _encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``; long texts are encoded on a worker thread so the event loop never stalls."""
    if len(text) > LONG_PROMPT_CHARS:
        encoding = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
    else:
        encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(encoding.ids)


def _blame_constraint(error: BackendError, chat: ChatPrompt | None) -> BackendError:
    """An engine's refusal of a constrained request names the request field that asked for the constraint."""
    if (
        isinstance(error, InvalidRequestError)
        and not isinstance(error, SlowClientError)
        and error.param is None
        and chat is not None
        and chat.so_param
    ):
        error.param = chat.so_param
    return error


def _prompt_tokens(
    table: TokenTable, prompt_ids: Sequence[int] | np.ndarray, values: Sequence[float] | None
) -> list[PromptToken]:
    """The echoed prompt's tokens with their logprobs and character offsets in the echoed text.

    The engine scores every token but the first (``values[i]`` is for ``prompt_ids[i + 1]``) and gives no
    alternatives for prompt positions. Offsets count the characters each token's bytes start, so special tokens
    that the text leaves out (BOS) take no room.
    """
    if values is None or len(values) != len(prompt_ids) - 1:
        raise UpstreamError(
            f"the engine returned {0 if values is None else len(values)} prompt logprobs for a prompt of "
            f"{len(prompt_ids)} tokens"
        )
    text_of, bytes_of = table.text_of, table.bytes_of
    pieces = [bytes_of[i] for i in prompt_ids]
    joined = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    starts_char = np.r_[0, np.cumsum((joined & 0xC0) != 0x80)]  # characters begun before each byte position
    byte_starts = np.r_[0, np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)))[:-1]]
    offsets = starts_char[byte_starts].tolist()
    logprobs: list[float | None] = [None, *values]
    return list(map(PromptToken, [text_of[i] for i in prompt_ids], logprobs, offsets))


def _resolve_max_tokens(request: GenerateRequest, prompt_len: int, max_model_len: int) -> int:
    """The output bound sent to the engine: the client's, or the rest of the context (never DeepInfer's 16); with
    ``fit_context``, the client's bound cut to the rest of the context.

    0 (score the prompt only) needs room for the one token an engine always generates.
    """
    room = max_model_len - prompt_len
    asked = request.sampling.max_tokens
    if asked is not None and request.sampling.fit_context and room >= 1:
        return min(asked, room)
    if asked is None:
        if room < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for any output.",
                param="messages" if request.messages is not None else "prompt",
            )
        return room
    if max(asked, 1) > room:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return asked

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
from backends.engine.detokenizer import IncrementalDetokenizer, TokenTable
from backends.engine.driver import EngineDriver
from backends.engine.prompts import (
    DEFAULT_PREPARE_THREADS,
    ChatPrompt,
    ChatTemplate,
    OutputParser,
    PromptPreparer,
)
from backends.engine.protocol import EOS_TOKEN_ID, Engine, EngineOutput, FinishReason, MetricSample
from backends.engine.stop import StopMatcher
from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    OverloadedError,
    SlowClientError,
    UnavailableError,
    UpstreamError,
)
from backends.interface import (
    Delta,
    Event,
    Finish,
    GenerateRequest,
    PromptEcho,
    PromptToken,
    TokenizerInfo,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
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
            _Choice(
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
            while remaining:
                index, item = await outputs.get()
                if isinstance(item, BackendError):
                    live.discard(engine_ids[index])
                    raise _blame_constraint(item, chat)
                choice = choices[index]
                if not echoed[index]:  # the prompt step's output carries the prompt logprobs
                    echoed[index] = True
                    if item[0].finished:
                        _finish_reason(item[0])  # raises for a request that ended in error before it ran
                    scores = item[0].prompt_logprobs
                    if len(prompt_ids) > INLINE_PROMPT_TOKENS:
                        entries = await asyncio.to_thread(_prompt_tokens, table, prompt_ids, scores)
                    else:
                        entries = _prompt_tokens(table, prompt_ids, scores)
                    yield PromptEcho(index, echo_text, entries)
                if score_only:
                    remaining -= 1
                    if item[-1].finished:
                        _finish_reason(item[-1])  # raises for a request the engine refused (context, resources)
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


def _prompt_tokens(table: TokenTable, prompt_ids: Sequence[int], values: Sequence[float] | None) -> list[PromptToken]:
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


class _Choice:
    """Turns one engine request's outputs into deltas: detokenize, match stops, parse, format logprobs."""

    __slots__ = (
        "_detok",
        "_logprobs",
        "_parser",
        "_reasoning_end",
        "_reported",
        "_stop",
        "_table",
        "end_logprobs",
        "index",
        "reasoning_tokens",
        "tokens",
    )

    def __init__(
        self,
        index: int,
        table: TokenTable,
        detok: IncrementalDetokenizer,
        stops: list[str],
        logprobs: bool,
        parser: OutputParser | None = None,
        reasoning_end: int | None = None,
    ) -> None:
        self.index = index
        self._table = table
        self._detok = detok
        self._stop = StopMatcher(stops) if stops else None
        self._logprobs = logprobs
        self._parser = parser
        self._reasoning_end = reasoning_end
        self.tokens = 0
        self._reported = 0  # tokens the deltas so far accounted for
        self.reasoning_tokens = 0
        self.end_logprobs: list[TokenLogprob] | None = None  # the EOS that ended the choice, counted as output

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self._stop.matched if self._stop is not None else None

    def consume(self, outputs: Sequence[EngineOutput]) -> tuple[Delta | None, str | None]:
        """Returns the delta to emit (if any) and the OpenAI finish reason once the choice is done."""
        last = outputs[-1]
        finish: str | None = None
        if last.finished:
            finish = _finish_reason(last)
            # A "stop" finish carries the EOS token, which is not output; under ignore_eos an EOS sampled on the
            # way to max_tokens ("length") is an ordinary token (empty text, but counted and given logprobs).
            real = list(outputs[:-1]) if finish == FinishReason.STOP else list(outputs)
        else:
            real = outputs
        self.tokens = last.num_output_tokens
        text = self._detok.push([o.token_id for o in real]) if real else ""
        if finish is not None:
            text += self._detok.flush()
        matched = False
        if self._stop is not None:
            text, matched = self._stop.push(text)
            if matched:
                finish = "stop"
            elif finish is not None:
                text += self._stop.flush()
        if self._logprobs and finish == FinishReason.STOP and last.finished and not matched:
            self.end_logprobs = self._format_logprobs([last])
        logprobs = self._format_logprobs(real) if self._logprobs and real else None
        if self._parser is not None:
            return self._parse(text, real, logprobs, finish)
        if not text and logprobs is None:
            return None, finish
        return Delta(self.index, text, logprobs, tokens=self._report()), finish

    def _report(self) -> int:
        """The tokens generated since the previous delta, which the next delta accounts for."""
        tokens = self.tokens - self._reported
        self._reported = self.tokens
        return tokens

    def _parse(
        self, text: str, real: Sequence[EngineOutput], logprobs: list[TokenLogprob] | None, finish: str | None
    ) -> tuple[Delta | None, str | None]:
        """Split the step's text into reasoning, content and tool calls (the model family's parser)."""
        parser = self._parser
        assert parser is not None
        was_reasoning = parser.in_reasoning
        reasoning, content, calls = parser.push(text)
        if finish is not None:
            more_reasoning, more_content, more_calls = parser.finish()
            reasoning += more_reasoning
            content += more_content
            calls = _merge_call_pieces(calls, more_calls)
            if finish == "stop" and parser.called:
                finish = "tool_calls"
        if was_reasoning and real:
            self.reasoning_tokens += self._count_reasoning(real, still=parser.in_reasoning and finish is None)
        if not (reasoning or content or calls) and logprobs is None:
            return None, finish
        return Delta(self.index, content, logprobs, reasoning, calls or None, self._report()), finish

    def _count_reasoning(self, outputs: Sequence[EngineOutput], *, still: bool) -> int:
        """Tokens of this step spent reasoning: all of them, or those up to and including the closing tag."""
        if still:
            return len(outputs)
        end = self._reasoning_end
        for position, output in enumerate(outputs):
            if output.token_id == end:
                return position + 1
        return len(outputs)

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


def _merge_call_pieces(first: Sequence[ToolCallDelta], second: Sequence[ToolCallDelta]) -> Sequence[ToolCallDelta]:
    """Concatenate tool-call pieces, joining a call's header and its arguments when they meet."""
    if not second:
        return first
    if not first:
        return second
    last, head = first[-1], second[0]
    if head.index == last.index and head.id is None:
        return [*first[:-1], last._replace(arguments=last.arguments + head.arguments), *second[1:]]
    return [*first, *second]


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
    if reason == FinishReason.SO_FAILED:
        if output.num_output_tokens <= 1:  # before the first token: the grammar did not compile
            raise InvalidRequestError(
                "the engine could not compile the output constraint of this request (response_format or "
                "tool_choice); check the schema, regex or grammar",
                code="invalid_output_constraint",
            )
        raise UpstreamError("the engine's output constraint failed during generation", code="output_constraint_failed")
    raise UpstreamError(f"the engine ended the request with finish_reason {reason!r}")

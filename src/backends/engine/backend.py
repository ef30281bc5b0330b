"""A backend over an in-process engine: prompt encoding and the engine driver; each request's events are an
``EngineEvents`` (``backends.engine.events``: per-choice output processing)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from tokenizers import Tokenizer

from backends.engine.choice import Choice
from backends.engine.detokenizer import TokenTable
from backends.engine.driver import DriverStats, EngineDriver, Sink
from backends.engine.events import EngineEvents, EngineRun
from backends.engine.prompts import (
    DEFAULT_PREPARE_THREADS,
    ChatTemplate,
    ImageResolver,
    PreparedPrompt,
    PromptPreparer,
    SamplingPolicyTemplate,
    TokenizerBoundTemplate,
)
from backends.engine.prompts import (
    ChatPrompt as ChatPrompt,  # re-exported, as it was defined here before
)
from backends.engine.prompts import (
    OutputParser as OutputParser,  # re-exported: the parser protocol was defined beside the choice code
)
from backends.engine.protocol import EOS_TOKEN_ID, Engine, EngineView, MetricSample
from backends.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    UnavailableError,
)
from backends.interface import (
    IMAGES_FEATURE,
    GenerateRequest,
    TokenizerInfo,
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
BOS_TOKEN_ID, PAD_TOKEN_ID = 0, 2
"""DeepInfer's tokenizer policy: BOS 0, EOS 1 (``EOS_TOKEN_ID``), PAD 2."""


class Driver(Protocol):
    """What a backend over engines needs of the thing that steps them: one engine on a thread here
    (``EngineDriver``), or ranks in worker processes (``backends.workers.driver.DataParallelDriver``)."""

    @property
    def engine(self) -> EngineView | None: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def stats(self) -> DriverStats: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add(
        self,
        request_id: str,
        sampling_params: dict[str, Any],
        prompt_token_ids: np.ndarray,
        sink: Sink,
        index: int,
        user_id: str = "",
        multi_modal_data: dict[str, Any] | None = None,
    ) -> int | None: ...

    def abort(self, request_ids: list[str]) -> None: ...


D = TypeVar("D", bound=Driver)


class DrivenEngines(Generic[D]):
    """Serves requests from the engines a driver steps: prompt preparation, engine requests and their events. The
    request path is this one code whichever driver is underneath."""

    supported_sampling: frozenset[str] = frozenset()
    supported_features: frozenset[str] = frozenset()

    def __init__(
        self,
        name: str,
        kind: str,
        driver: D,
        chat_template: ChatTemplate,
        *,
        prepare_threads: int = DEFAULT_PREPARE_THREADS,
        images: ImageResolver | None = None,
    ) -> None:
        """``images``: how chats' images are resolved; without one, image parts are refused (a 400)."""
        self.name = name
        self.kind = kind
        features = type(self).supported_features | getattr(chat_template, "features", frozenset())
        self.supported_features = features | {IMAGES_FEATURE} if images is not None else features
        self.driver = driver
        self._chat_template = chat_template
        self._sampling_policy = chat_template if isinstance(chat_template, SamplingPolicyTemplate) else None
        """The template as a ``SamplingPolicyTemplate``, if it is one: checked once (a protocol's isinstance inspects
        its members on every call)."""
        self._prompts = PromptPreparer(chat_template, threads=prepare_threads, name=name, images=images)
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
            if isinstance(self._chat_template, TokenizerBoundTemplate):  # its per-tokenizer state, before traffic
                await asyncio.to_thread(self._chat_template.bind_tokenizer, engine.tokenizer)
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

    def generate(self, request: GenerateRequest) -> EngineEvents:
        return EngineEvents(functools.partial(self._open, request))

    async def _open(self, request: GenerateRequest) -> EngineRun:
        """Prepares the prompt and adds the request's choices to the engine: the first step of its events."""
        if not self._started or not self.driver.alive:
            raise UnavailableError(f"backend {self.name!r} is not ready: {self.readiness()[1]}")
        table = self._table
        engine = self.driver.engine
        assert table is not None and engine is not None
        policy = self._sampling_policy
        if request.messages is not None and policy is not None:
            served = policy.served_sampling(request)
            if served is not request.sampling:
                request = dataclasses.replace(request, sampling=served)
        reject_unsupported(request, sampling=self.supported_sampling, features=self.supported_features)
        prompt = await self._prompts.prepare(request)
        prompt_ids, chat = prompt.ids, prompt.chat
        max_tokens = _resolve_max_tokens(request, prompt.token_count, engine.max_model_len)
        sampling = request.sampling
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
        make_parser = chat.parser if chat is not None else None
        reasoning_end = chat.reasoning_end_token if chat is not None else None
        choices = [
            Choice(
                index,
                table,
                table.new_detokenizer(),
                sampling.stop,
                sampling.logprobs,
                make_parser(stops=sampling.stop) if make_parser is not None else None,
                reasoning_end,
            )
            for index in range(request.n)
        ]
        echo_text = None
        if request.echo:
            echo_text = request.prompt if request.prompt is not None else table.tokenizer.decode(prompt_ids.tolist())
        run = EngineRun(
            self.driver.abort,
            engine_ids,
            choices,
            request.max_buffered_tokens,
            prompt_ids,
            table,
            chat,
            echo_text=echo_text,
            scoring=scoring,
            score_only=max_tokens == 0,  # echo with max_tokens 0: score the prompt, generate nothing
            prompt_count=prompt.token_count,
        )
        try:
            self._add_choices(request, run, engine_ids, params, prompt_array, prompt)
        except BaseException:
            run.close()
            raise
        return run

    def _add_choices(
        self,
        request: GenerateRequest,
        run: EngineRun,
        engine_ids: list[str],
        params: dict[str, Any],
        prompt_array: np.ndarray,
        prompt: PreparedPrompt,
    ) -> None:
        """Adds each choice to the engine (choice i seeded ``seed + i``), with the prompt's images."""
        multi_modal_data = prompt.images.multi_modal_data() if prompt.images is not None else None
        seed = request.sampling.seed
        for index, engine_id in enumerate(engine_ids):
            rank = self.driver.add(
                engine_id,
                {**params, "seq_seed": None if seed is None else seed + index},
                prompt_array,
                run.sink,
                index,
                request.user or "",
                multi_modal_data,
            )
            if rank is not None and request.trace is not None:
                request.trace.annotate("gateway.dp.rank", rank)  # a request's choices share one rank

    # ---- TokenizingBackend ------------------------------------------------------------------------------------

    def _ready_engine(self) -> EngineView:
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
            chat = self._chat_template.render(request, engine.tokenizer)
            if chat.token_ids is not None:
                return list(chat.token_ids)
            text = chat.text
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


class EngineBackend(DrivenEngines[EngineDriver]):
    """Serves requests from one in-process engine, which an ``EngineDriver`` builds and steps on its thread."""

    def __init__(
        self,
        name: str,
        kind: str,
        engine_factory: Callable[[], Engine],
        chat_template: ChatTemplate,
        *,
        prepare_threads: int = DEFAULT_PREPARE_THREADS,
        images: ImageResolver | None = None,
    ) -> None:
        driver = EngineDriver(engine_factory, name=name)
        super().__init__(name, kind, driver, chat_template, prepare_threads=prepare_threads, images=images)


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

"""Counting a prompt's tokens (``/v1/messages/count_tokens``) the way the request itself would be served.

A count is a request: the model's routing policy picks the target (pinning, breakers and fallbacks included, and the
target's in-flight count and breaker see it), and the key's budgets admit it. How the target counts depends on what
it offers:

- a backend that exposes its tokenizer (``TokenizingBackend``: the engine backends) encodes the prompt exactly as
  generation would, and generates nothing; the key is charged a request and no tokens;
- a backend that counts without generating where it can be exact (``PromptCountingBackend``: LMDeploy asks a
  node's own ``/v1/messages/count_tokens``, exact for plain-text conversations) does so; no tokens are charged;
- otherwise (LMDeploy with tools, thinking or template arguments, or behind its proxy) the request runs with
  ``max_tokens`` 1 and the prompt tokens of its usage are the count. LMDeploy has no exact count short of that:
  ``/v1/encode`` takes one string (no messages, no tools), and its ``count_tokens`` renders the messages without the
  tools or template arguments. The one token is real work, so the key is charged for it like any request.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable
from typing import NamedTuple

from starlette.requests import Request

from backends.errors import UpstreamError
from backends.interface import (
    Backend,
    Event,
    EventStream,
    GenerateRequest,
    PromptCountingBackend,
    SamplingOptions,
    TokenizingBackend,
    Usage,
    has_image_parts,
)
from gateway.capabilities import capability
from gateway.gateway_state import GatewayState
from gateway.metrics import RequestCost
from gateway.pipeline import key_limits, route, within_limits


class Counted(NamedTuple):
    tokens: int
    headers: dict[str, str]
    """``X-Backend`` (the target that counted) and the key's rate-limit headers."""


class _Counting:
    """Opens a count on the target the router chose, and remembers whether counting generated (and so cost)."""

    __slots__ = ("generated", "request")

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.generated = False

    def open(self, backend: Backend) -> EventStream[Event]:
        self.generated = False
        tokenizing = capability(backend, TokenizingBackend)
        if tokenizing is not None and not has_image_parts(self.request.messages or ()):
            return _usage_of(_tokenized_length(tokenizing, self.request))
        counting = capability(backend, PromptCountingBackend)
        return self._counted_else_generated(backend, counting)

    async def _counted_else_generated(
        self, backend: Backend, counting: PromptCountingBackend | None
    ) -> AsyncGenerator[Event, None]:
        """The backend's own count when it has an exact one, else the usage of a one-token generation."""
        counted = await counting.count_prompt_tokens(self.request) if counting is not None else None
        if counted is not None:
            yield Usage(counted, 0)
            return
        self.generated = True
        one_token = SamplingOptions(max_tokens=1, fit_context=True)
        async with contextlib.aclosing(
            backend.generate(dataclasses.replace(self.request, sampling=one_token))
        ) as events:
            async for event in events:
                yield event


async def _tokenized_length(tokenizing: TokenizingBackend, request: GenerateRequest) -> int:
    return len(await tokenizing.tokenize(request))


async def _usage_of(count: Awaitable[int]) -> AsyncGenerator[Event, None]:
    """A prompt's length as the one event of a stream: what a generation would report in its usage."""
    yield Usage(await count, 0)


async def _usage(events: EventStream[Event], backend: str) -> Usage:
    try:
        async for event in events:
            if isinstance(event, Usage):
                return event
    finally:
        await events.aclose()
    raise UpstreamError(f"backend {backend!r} reported no usage for the prompt")


async def count_prompt(request: Request, state: GatewayState, generate: GenerateRequest) -> Counted:
    """The prompt tokens of ``generate`` on the target its model's routing chooses, admitted and charged: the first
    hops of ``gateway.pipeline``, then the count instead of a stream."""
    counting = _Counting(generate)
    async with within_limits(request, state, 1) as reservation:
        events = route(request, state, generate, counting.open)
        usage = await _usage(events, events.backend.name)
        cost = RequestCost(200, usage if counting.generated else None, 0, False, reached_backend=counting.generated)
        await key_limits(state).settle(reservation, cost, generate.log)
    return Counted(usage.prompt_tokens, {"X-Backend": events.backend.name, **reservation.headers})

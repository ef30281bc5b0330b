"""Per-key request and token limits (429) and per-backend admission control (503), both with Retry-After.

Budgets are token buckets that refill over a minute (``gateway.budgets``). A request takes one request and
reserves tokens when it is admitted: its prompt, estimated from the size of what the client sent
(``estimate_prompt_tokens``), plus its ``max_tokens`` (or ``server.limits.token_reservation`` when it names none), never
more than the whole budget; so concurrent requests cannot all pass a spent budget. When it ends, whichever way,
the reservation is settled with what the request used (``KeyLimits.settle``): the backend's usage when it reported
one; otherwise the output tokens the gateway forwarded plus the prompt (a client that hangs up, a deadline, a stall,
a failure mid-stream, an upstream stream cut before its usage): exact when the backend said how long it was on its
first delta (``Delta.prompt_tokens``: the engine backends), else the estimate. A request that never reached a backend,
or that the backend refused before producing anything, gives its whole reservation back.

With ``server.stores.state_store`` the buckets live in Redis and are exact across processes and replicas; without it, or
while the store is down, each of a host's N front-end processes allows 1/N of every budget. Admission to a
backend (a slot, and the order of those waiting for one) is ``gateway.flow_control``'s.

The rules live here, away from any one API's routes: every API that generates (chat, completions, Responses, and
any other) admits with ``reserved`` and hands the reservation to its ``RequestObserver``, whose end settles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request

from backends.interface import IMAGE_TOKENS_BOUND, image_parts
from gateway.auth import key_label, request_label
from gateway.budgets import BudgetStore, Clock, Draw, LocalBudgets, RedisBudgets, Take, bucket_key, seconds_until
from gateway.errors import APIError
from gateway.metrics import RequestCost
from gateway.server_config import ApiKeyConfig, ServerConfig
from gateway.shared_store import SharedStateStore

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4
"""What a prompt is reserved at before it is tokenized: a token per 4 bytes of what the client sent (a JSON
body is at least as long as its text; English text runs at about 4 bytes per token, other scripts at fewer)."""
CHARGED_WITHOUT_OUTPUT = frozenset({408, 499, 504})
"""Ends before any output that still cost the backend the prompt: the client left (or stopped reading), or the
deadline passed while the backend worked on it. Any other end before output (the backend refused the request,
was unavailable or failed) charges nothing."""


def estimate_prompt_tokens(body_bytes: int) -> int:
    """The tokens a prompt is reserved at, from the size of the request body that carries it."""
    return math.ceil(body_bytes / BYTES_PER_TOKEN)


def image_estimate(messages: Sequence[Mapping[str, Any]] | None) -> tuple[int, int]:
    """(body bytes the chat's images take, tokens to reserve for them): an image's base64 says nothing of its
    tokens, so each is reserved at the most an image can take (``IMAGE_TOKENS_BOUND``) instead, and settled
    with its exact count."""
    taken = count = 0
    for _, part in image_parts(messages or ()):
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else None
        taken += len(url) if isinstance(url, str) else 0
        count += 1
    return taken, count * IMAGE_TOKENS_BOUND


class Reservation:
    """What admitting a request took from its key's budgets (and the rate-limit headers to send). Settled once:
    with the request's cost when it ends (``KeyLimits.settle``), or released whole (``KeyLimits.release``)."""

    __slots__ = ("headers", "label", "pending", "prompt_estimate", "reserved_tokens", "settled")

    def __init__(self, label: str, reserved_tokens: int, prompt_estimate: int, headers: dict[str, str]) -> None:
        self.label = label
        self.reserved_tokens = reserved_tokens
        self.prompt_estimate = prompt_estimate
        self.headers = headers
        self.settled = False
        self.pending: asyncio.Task[None] | None = None
        """The settlement ``settle_soon`` started, until it is done."""


def tokens_used(reservation: Reservation, cost: RequestCost) -> int:
    """What a request is charged: its usage when the backend reported one; else the output it forwarded plus its
    prompt (exact when the backend said how long it was, as the engine backends do on their first delta, else the
    estimate), if the backend worked on it (see ``CHARGED_WITHOUT_OUTPUT``; a request that admission shed, timed
    out or lost while it waited for a slot never reached one); else nothing."""
    if cost.usage is not None:
        return cost.usage.prompt_tokens + cost.usage.completion_tokens
    if not cost.output_started and (cost.status not in CHARGED_WITHOUT_OUTPUT or not cost.reached_backend):
        return 0
    return (cost.prompt_tokens or reservation.prompt_estimate) + cost.output_tokens


class KeyLimits:
    """Requests-per-minute and tokens-per-minute budgets for every client key label."""

    def __init__(
        self,
        server: ServerConfig,
        *,
        store: SharedStateStore | None = None,
        processes: int = 1,
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``clock`` refills the buckets, here and in the store; None: this process's monotonic clock here and
        the store's own clock there, so that replicas agree (tests give every replica one frozen clock)."""
        self._limits: dict[str, tuple[int | None, int | None]] = {}
        for position, key in enumerate(server.auth.client_keys()):
            self._limits[key_label(key, position)] = _limits_of(key, server)
        self._default = (server.limits.requests_per_minute, server.limits.tokens_per_minute)
        self._reservation = server.limits.token_reservation
        self._local = LocalBudgets(clock or time.monotonic, share=1.0 / processes)
        self.store = store
        self._shared: BudgetStore | None = RedisBudgets(store.client, clock=clock) if store is not None else None
        self._settling: set[asyncio.Task[None]] = set()
        self.charged = Counter(
            "gateway_key_tokens",
            "Tokens charged to each API key when its requests ended (prompt plus completion; see README, Per-key "
            "limits), whether or not the key has a token budget.",
            ("key",),
            registry=registry,
        )
        self.refused = Counter(
            "gateway_key_rate_limited", "Requests refused with 429 by a key's budget.", ("key",), registry=registry
        )

    def limits_of(self, label: str) -> tuple[int | None, int | None]:
        return self._limits.get(label, self._default)

    async def admit(self, label: str, max_tokens: int | None, prompt_estimate: int) -> Reservation:
        """Takes one request and reserves the prompt estimate plus ``max_tokens`` from the key's budgets; raises a
        429 with Retry-After when a budget cannot cover it."""
        rpm, tpm = self.limits_of(label)
        if rpm is None and tpm is None:
            return Reservation(label, 0, prompt_estimate, {})
        draws: list[Draw] = []
        reserved = 0
        if rpm is not None:
            draws.append(Draw(bucket_key(label, "requests"), rpm, 1, 1))
        if tpm is not None:
            output = max_tokens if max_tokens is not None else self._reservation
            reserved = min(tpm, prompt_estimate + output)
            draws.append(Draw(bucket_key(label, "tokens"), tpm, max(1, reserved), reserved))
        take = await self._take(draws)
        headers: dict[str, str] = {}
        waits: list[float] = []
        for draw, level in zip(draws, take.levels, strict=True):
            kind = "requests" if draw.key.endswith(":requests") else "tokens"
            headers[f"x-ratelimit-limit-{kind}"] = str(int(draw.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{kind}"] = f"{seconds_until(level, draw.capacity, draw.capacity):.3f}s"
            if not take.granted and level < min(draw.require, draw.capacity):
                waits.append(seconds_until(level, min(draw.require, draw.capacity), draw.capacity))
        if not take.granted:
            self.refused.labels(label).inc()
            retry = max(waits, default=1.0)
            raise APIError(
                429,
                f"Rate limit reached for {label}: retry after {retry:.1f} s.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(max(1, math.ceil(retry)))},
            )
        return Reservation(label, reserved, prompt_estimate, headers)

    async def settle(self, reservation: Reservation, cost: RequestCost, log: dict[str, object] | None = None) -> None:
        """Charges the request's cost against what it reserved, once (later calls change nothing), and notes the
        charge in its access-log line; returns when the budget holds the result, so a request's last byte can
        wait for it and the client's next request sees true ``x-ratelimit-*`` headers."""
        used = self._charge(reservation, cost, log)
        if used is not None:
            await self._settle(reservation, used)

    def settle_soon(self, reservation: Reservation, cost: RequestCost, log: dict[str, object] | None = None) -> None:
        """``settle`` from code that cannot wait (the end of a request as its observer sees it)."""
        used = self._charge(reservation, cost, log)
        if used is not None:
            task = reservation.pending = asyncio.get_running_loop().create_task(self._settle(reservation, used))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    def _charge(self, reservation: Reservation, cost: RequestCost, log: dict[str, object] | None) -> int | None:
        if reservation.settled:
            return None
        reservation.settled = True
        used = tokens_used(reservation, cost)
        if log is not None:
            log["charged_tokens"] = used
        return used

    async def _settle(self, reservation: Reservation, used: int) -> None:
        await self._refund(reservation, reservation.reserved_tokens - used)
        if used:
            self.charged.labels(reservation.label).inc(used)
        reservation.pending = None

    async def release(self, reservation: Reservation) -> None:
        """Gives the whole reservation back: the request failed before a backend took it (unknown model, no
        route, a validation error after admission). A reservation its observer settled already is left as it is
        (this waits for that settlement): the request did reach a backend."""
        if reservation.settled:
            if reservation.pending is not None:
                await asyncio.shield(reservation.pending)
            return
        reservation.settled = True
        await self._refund(reservation, reservation.reserved_tokens)

    async def _refund(self, reservation: Reservation, delta: int) -> None:
        _, tpm = self.limits_of(reservation.label)
        if tpm is not None and delta != 0:
            await self._adjust(bucket_key(reservation.label, "tokens"), tpm, delta)

    async def aclose(self) -> None:
        """Waits for the settlements under way (for shutdown)."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def _take(self, draws: list[Draw]) -> Take:
        if self._shared is not None and self.store is not None and self.store.usable():
            try:
                take = await self._shared.take(draws)
            except self.store.failures_raised as exc:
                self.store.failed(exc)
            else:
                self.store.succeeded()
                return take
        return await self._local.take(draws)

    async def _adjust(self, key: str, capacity: float, delta: float) -> None:
        if self._shared is not None and self.store is not None and self.store.usable():
            try:
                await self._shared.adjust(key, capacity, delta)
            except self.store.failures_raised as exc:
                self.store.failed(exc)
            else:
                self.store.succeeded()
                return
        await self._local.adjust(key, capacity, delta)


@contextlib.asynccontextmanager
async def reserved(
    request: Request,
    limits: KeyLimits,
    max_tokens: int | None,
    *,
    prompt_tokens: int = 0,
    messages: Sequence[Mapping[str, Any]] | None = None,
) -> AsyncIterator[Reservation]:
    """The request, admitted against the budgets of the key it came with (a 429 when they are spent): its prompt
    estimated from its body (its chat ``messages``' images at their bound, ``image_estimate``), plus
    ``prompt_tokens`` the body does not carry (a stored conversation it continues).
    Whatever fails inside the block before a backend takes the request over (routing, validation after admission)
    gives the reservation back; once the request's observer holds it, the request's end settles it instead."""
    body = await request.body()  # read already (the route parsed it): the bytes are cached
    image_bytes, image_tokens = image_estimate(messages)
    prompt = estimate_prompt_tokens(max(0, len(body) - image_bytes)) + image_tokens + prompt_tokens
    reservation = await limits.admit(request_label(request), max_tokens, prompt)
    try:
        yield reservation
    except BaseException:
        await limits.release(reservation)
        raise


def _limits_of(key: ApiKeyConfig, server: ServerConfig) -> tuple[int | None, int | None]:
    return (
        key.requests_per_minute if key.requests_per_minute is not None else server.limits.requests_per_minute,
        key.tokens_per_minute if key.tokens_per_minute is not None else server.limits.tokens_per_minute,
    )

"""How a model picks one of its available targets for a request.

Each policy is a small object with ``pick(candidates, request, session)``; candidates are the model's
targets that are ready, not cut off by their breaker, and have a weight above 0 (never empty). A pick costs a
few microseconds: no I/O, no allocation beyond a short list, the affinity key hashed once per request.
"""

from __future__ import annotations

import math
import random
import zlib
from array import array
from collections.abc import Sequence
from typing import Protocol

from backends.interface import GenerateRequest
from gateway.routing.targets import Target

_MASK = (1 << 64) - 1
_TWO_64 = float(1 << 64)


class Policy(Protocol):
    name: str

    def pick(self, candidates: Sequence[Target], request: GenerateRequest | None, session: str | None) -> Target: ...


class WeightedPolicy:
    """Random split in proportion to the weights (an A/B or canary split)."""

    name = "weighted"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def pick(self, candidates: Sequence[Target], request: GenerateRequest | None, session: str | None) -> Target:
        if len(candidates) == 1:
            return candidates[0]
        x = self._random() * sum(t.weight for t in candidates)
        for target in candidates:
            x -= target.weight
            if x < 0:
                return target
        return candidates[-1]


class LeastOutstandingPolicy:
    """The target with the fewest requests in flight relative to its weight; ties rotate so that sequential
    traffic spreads instead of always landing on the first target."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[Target], request: GenerateRequest | None, session: str | None) -> Target:
        n = len(candidates)
        start = self._turn % n
        self._turn = start + 1
        best = candidates[start]
        best_score = (best.load.total + 1) / best.weight
        for i in range(1, n):
            target = candidates[(start + i) % n]
            score = (target.load.total + 1) / target.weight
            if score < best_score:
                best, best_score = target, score
        return best


class PrefixAffinityPolicy:
    """Requests with the same key go to the same target, so the engine's prefix cache hits.

    The key is the session (``X-Session-ID`` header, else the ``user`` field), else the first ``prefix_chars``
    characters of the prompt. Targets are ranked by weighted rendezvous hashing of the key, so adding or
    removing a target only moves the keys that were on it. Bounded load: a target already holding
    ``load_factor`` times its share of the in-flight requests (this one included) plus ``load_slack`` is
    passed over for the next in its ranking (consistent hashing with bounded loads), so one hot prefix cannot
    pile up on one engine; the slack keeps affinity when traffic is low and shares are fractions of a request.
    """

    name = "prefix_affinity"

    def __init__(self, prefix_chars: int, load_factor: float, load_slack: int = 0) -> None:
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self.load_slack = load_slack

    def pick(self, candidates: Sequence[Target], request: GenerateRequest | None, session: str | None) -> Target:
        if len(candidates) == 1:
            return candidates[0]
        key = affinity_key(request, session, self.prefix_chars)
        scores = [rendezvous_score(key, t) for t in candidates]
        best = candidates[scores.index(max(scores))]
        per_weight = self.load_factor * (sum(t.load.total for t in candidates) + 1) / sum(t.weight for t in candidates)
        if best.load.total < per_weight * best.weight + self.load_slack:
            return best  # the usual case: no sort
        ranked = [candidates[i] for i in sorted(range(len(scores)), key=scores.__getitem__, reverse=True)]
        for target in ranked[1:]:
            if target.load.total < per_weight * target.weight + self.load_slack:
                return target
        return min(ranked, key=lambda t: t.load.total / t.weight)  # unreachable with load_factor >= 1


def rendezvous_score(key: int, target: Target) -> float:
    """Weighted rendezvous (highest random weight) score: -w / ln(u), u uniform in (0, 1) from (key, target)."""
    x = (key ^ target.seed) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK  # splitmix64 finalizer: a cheap, well-mixed 64-bit hash
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return -target.weight / math.log((x + 0.5) / _TWO_64)


def affinity_key(request: GenerateRequest | None, session: str | None, prefix_chars: int) -> int:
    """The key a request is kept on a target by: its session, else the start of its prompt. CRC-32: the same
    in every gateway replica, about 4x cheaper than a cryptographic hash, and mixed well enough by
    ``rendezvous_score``."""
    if session:
        return zlib.crc32(session.encode(), 1)
    if request is None:
        return 0
    if request.user:
        return zlib.crc32(request.user.encode(), 2)
    if request.messages is not None:
        text = _messages_prefix(request.messages, prefix_chars)
    elif request.prompt is not None:
        text = request.prompt[:prefix_chars]
    else:
        ids = request.prompt_token_ids or []
        return zlib.crc32(array("q", ids[: max(1, prefix_chars // 4)]).tobytes())  # ~4 characters per token
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _messages_prefix(messages: list[dict[str, object]], prefix_chars: int) -> str:
    """The first ``prefix_chars`` characters of the conversation, roles included, in the order the chat
    template renders it (system prompt first), without rendering the template."""
    parts: list[str] = []
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        piece = f"{message.get('role')}\x1f{content or ''}\x1e"
        parts.append(piece)
        size += len(piece)
        if size >= prefix_chars:
            break
    return "".join(parts)[:prefix_chars]


def build_policy(
    name: str, *, prefix_chars: int, load_factor: float, load_slack: int, rng: random.Random | None = None
) -> Policy:
    if name == "least_outstanding":
        return LeastOutstandingPolicy()
    if name == "prefix_affinity":
        return PrefixAffinityPolicy(prefix_chars, load_factor, load_slack)
    return WeightedPolicy(rng)

"""Chooses the data-parallel rank for each request: least outstanding work, prefix affinity, fairness on ties.

Work is counted in requests: a rank's load is its outstanding requests plus its queued prompt tokens (dispatched,
not yet prefilled) divided by ``prefill_tokens_per_request``, the exchange rate between prefill and decode work.
The same rate prices a prefix-cache hit: a rank whose engine probably holds the first ``k`` tokens of the prompt
(it was sent the same prefix before) gets ``k / prefill_tokens_per_request`` off its load. So a long shared prefix
(a system prompt, a long conversation) keeps going to the same rank unless that rank is busier than the hit is
worth, and a short one never outweighs real imbalance. Ranks equally loaded are taken in turn.

Prefixes are hashed the same way in every process (BLAKE2b, chained block by block), so that several dispatchers
(front ends) share what they know: each rank passes the prefix hashes of the prompts it gets on to its other
dispatchers (``learn``), and a prefix goes to the same rank whichever front end it reaches.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

AFFINITY_BLOCK_TOKENS = 64
"""Prefixes are remembered per block of this many tokens; a shorter shared prefix earns nothing."""
AFFINITY_MAX_BLOCKS = 256
"""Only the first this-many blocks are hashed, bounding the dispatcher's cost per request."""
AFFINITY_TABLE_SIZE = 65_536
"""Prefix blocks remembered (least recently used are forgotten, as an engine's cache would evict them)."""
PREFILL_TOKENS_PER_REQUEST = 512
"""How many queued prompt tokens weigh as much as one outstanding request."""


class RankBalancer:
    """Pure policy: the driver tells it the loads and which ranks are up, it answers with a rank."""

    def __init__(
        self,
        size: int,
        *,
        block_tokens: int = AFFINITY_BLOCK_TOKENS,
        prefill_tokens_per_request: int = PREFILL_TOKENS_PER_REQUEST,
        table_size: int = AFFINITY_TABLE_SIZE,
    ) -> None:
        self.size = size
        self.block_tokens = block_tokens
        self.prefill_tokens_per_request = prefill_tokens_per_request
        self._table: OrderedDict[int, int] = OrderedDict()
        self._table_size = table_size
        self._next = 0  # round-robin start among equally loaded ranks

    def load(self, outstanding: int, queued_tokens: int) -> float:
        return outstanding + queued_tokens / self.prefill_tokens_per_request

    def choose(self, prompt: np.ndarray, loads: Sequence[float], up: Sequence[bool]) -> int:
        """The rank for a request with ``prompt``; records the prompt's prefix blocks against it."""
        return self.choose_for(self.prefix_hashes(prompt), loads, up)

    def choose_for(self, prefix: np.ndarray, loads: Sequence[float], up: Sequence[bool]) -> int:
        """``choose`` for a prompt whose ``prefix_hashes`` are ``prefix``."""
        hashes = prefix.tolist()
        hit_rank, hit_tokens = self._longest_hit(hashes)
        best = -1
        best_cost = 0.0
        size = self.size
        for offset in range(size):
            rank = (self._next + offset) % size
            if not up[rank]:
                continue
            cost = loads[rank]
            if rank == hit_rank:
                cost -= hit_tokens / self.prefill_tokens_per_request
            if best < 0 or cost < best_cost:
                best, best_cost = rank, cost
        if best < 0:
            raise LookupError("no rank is up")
        if best != hit_rank:
            self._next = (best + 1) % size
        self._remember(hashes, best)
        return best

    def learn(self, rank: int, prefix: bytes) -> None:
        """Another dispatcher sent a prompt with these ``prefix_hashes`` (as bytes) to ``rank``."""
        self._remember(np.frombuffer(prefix, dtype="<u8").tolist(), rank)

    def forget(self, rank: int) -> None:
        """A restarted rank's engine starts with an empty cache: stop sending prefixes there for it."""
        stale = [h for h, r in self._table.items() if r == rank]
        for h in stale:
            del self._table[h]

    def prefix_hashes(self, prompt: np.ndarray) -> np.ndarray:
        """One 64-bit hash per whole block of the prompt (the first ``AFFINITY_MAX_BLOCKS``), each covering the
        blocks before it too; the same in every process."""
        block = self.block_tokens
        blocks = min(len(prompt) // block, AFFINITY_MAX_BLOCKS)
        data = np.ascontiguousarray(prompt[: blocks * block], dtype=np.int32).tobytes()
        width = block * 4
        blake2b = hashlib.blake2b
        digests = []
        digest = b""
        for start in range(0, len(data), width):  # each block's hash is keyed with the one before: a chain
            digest = blake2b(data[start : start + width], digest_size=8, key=digest).digest()
            digests.append(digest)
        return np.frombuffer(b"".join(digests), dtype="<u8")

    def _longest_hit(self, hashes: list[int]) -> tuple[int, int]:
        table = self._table
        for i in range(len(hashes) - 1, -1, -1):
            rank = table.get(hashes[i])
            if rank is not None:
                return rank, (i + 1) * self.block_tokens
        return -1, 0

    def _remember(self, hashes: list[int], rank: int) -> None:
        table = self._table
        for h in hashes:
            table[h] = rank
            table.move_to_end(h)
        while len(table) > self._table_size:
            table.popitem(last=False)

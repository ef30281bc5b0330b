"""The reference engine's prefix cache: which prompt blocks' KV it would still hold, by content, least recently used
out first.

A prompt is cut into blocks of ``block_size`` tokens; block ``i`` is keyed by a digest of its tokens chained to the
key of block ``i - 1``, so a key names the whole prefix up to the block's end (as paged KV caches key their blocks).
A request hits the longest run of leading blocks present, never its whole prompt: the last prompt token is always
computed, since its logits give the first output token. The bound is in blocks; a lookup or an insert makes the
blocks it touches the most recently used, parents after their children, so a prefix's tail is evicted before its
head and a key present implies every shorter prefix of it was present when it was last used.
"""

from __future__ import annotations

from collections import OrderedDict
from hashlib import blake2b

import numpy as np

_ROOT = b""


class PrefixCache:
    """Leading prompt blocks by content, LRU-bounded to ``capacity_blocks``; used from the engine thread only."""

    __slots__ = ("_blocks", "block_size", "capacity_blocks")

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be at least 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def block_keys(self, prompt: np.ndarray) -> list[bytes]:
        """The chained keys of the full blocks of ``prompt`` that may be reused (not the one holding its last token)."""
        size = self.block_size
        usable = (int(prompt.size) - 1) // size
        data = np.ascontiguousarray(prompt, dtype=np.int32).tobytes()
        width = size * 4
        keys: list[bytes] = []
        parent = _ROOT
        for block in range(usable):
            parent = blake2b(parent + data[block * width : (block + 1) * width], digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: list[bytes]) -> int:
        """Tokens of the longest cached run of leading blocks among ``keys``; those blocks become most recent."""
        blocks = self._blocks
        hit = 0
        for key in keys:
            if key not in blocks:
                break
            hit += 1
        for key in reversed(keys[:hit]):
            blocks.move_to_end(key)
        return hit * self.block_size

    def insert(self, keys: list[bytes]) -> None:
        """Keep the blocks of a prefilled prompt, evicting the least recently used beyond the bound."""
        blocks = self._blocks
        for key in reversed(keys):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

"""Automatic prefix caching: the KV of full prompt blocks, found again by the hash of everything before them.

Agent traffic repeats itself: the same system prompt, tool specifications and
retrieved passages open many requests. An engine that keeps the KV of prompt
blocks it has computed can skip them the next time they open a prompt. This
follows vLLM's automatic prefix caching (``enable_prefix_caching``, on by
default in vLLM V1) and SGLang's RadixAttention:

- a prompt is cut into blocks of ``block_tokens`` tokens; only full blocks are cached;
- a block's key is the hash of its tokens and its parent's key, so a block is
  reused only after the very same prefix;
- a lookup returns the leading blocks already cached; after a prefill the
  prompt's blocks are added;
- cached blocks take device memory; they are evicted least recently used first
  when running work needs the room (:meth:`PrefixCache.evict`).

The cache is bookkeeping: the engine it belongs to decides what a hit saves
(the sim engine: the prefill time of the cached tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class PrefixCache:
    """Cached prompt blocks, least recently used first.

    Args:
        block_tokens: tokens per block (vLLM's default block size is 16).
        block_bytes: device memory one cached block takes.
    """

    def __init__(self, block_tokens: int, block_bytes: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens: expected >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def keys(self, tokens: Iterable[str]) -> list[int]:
        """The chained keys of the full blocks of ``tokens`` (token texts), in prompt order."""
        keys, block, parent = [], [], 0
        for token in tokens:
            block.append(token)
            if len(block) == self.block_tokens:
                parent = hash((parent, tuple(block)))
                keys.append(parent)
                block = []
        return keys

    def match(self, keys: list[int]) -> int:
        """How many leading blocks of ``keys`` are cached; marks them recently used."""
        found = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            found += 1
        return found

    def insert(self, keys: list[int]) -> None:
        """Cache the blocks of ``keys`` (a computed prompt), most recently used."""
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until ``nbytes`` are freed (or the cache is empty); returns bytes freed."""
        freed = 0
        while self._blocks and freed < nbytes:
            self._blocks.popitem(last=False)
            freed += self.block_bytes
        return freed

    @property
    def nbytes(self) -> int:
        """Device memory the cached blocks take."""
        return len(self._blocks) * self.block_bytes

    def __len__(self) -> int:
        return len(self._blocks)

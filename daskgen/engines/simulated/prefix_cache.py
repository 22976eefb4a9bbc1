"""The simulated engine's prefix cache: which prompt tokens an engine has computed before.

Modelled on block-level automatic prefix caching (vLLM's, sglang's radix cache at block granularity): a
prompt is cut into blocks of ``block`` tokens; a block is identified by a hash of the whole prompt up to
its end, so it matches only under the same prefix.  A request's leading blocks found in the cache are
*cached tokens*; the rest are computed (the prefill) and their full blocks enter the cache.  The cache holds
at most ``capacity`` tokens' worth of blocks and evicts the least recently used.  A block cached by a
request admitted earlier in the same step counts as cached for the next (both engines share a computed
prefix within a batch); the last, partial block is never cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """An LRU of prompt blocks, ``capacity`` tokens at most (0: no cache: every prompt token is computed)."""

    def __init__(self, capacity: int, block: int = 16) -> None:
        self.capacity, self.block = capacity, block
        self.blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """Whether the cache can hold a block (else every prompt token is computed)."""
        return self.capacity >= self.block

    def admit(self, prompt: Sequence[int]) -> int:
        """The number of leading tokens of ``prompt`` found in the cache; its full blocks are cached after."""
        if not self.enabled:
            return 0
        hashes, h = [], 0
        for end in range(self.block, len(prompt) + 1, self.block):
            h = hash((h, tuple(prompt[end - self.block : end])))
            hashes.append(h)
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.blocks:
            hits += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) * self.block > self.capacity:
            self.blocks.popitem(last=False)
        return hits * self.block

"""The best hit rate routing could reach: one exact LRU over the whole pool's cache.

`LruBound` is the sim engine's own prefix cache (``cas_engine.sim.prefix_cache.PrefixCache``:
block radix tree, exact LRU, leaves first) with the capacity of every prefill instance
together, fed every prompt the replay sends, in the order sent, as the engines tokenize it. A
router that put every prompt where its longest cached prefix is, on a pool that shared its
memory, would hit what this hits; the engines' cached tokens over the same prompts, divided by
this, is how close the routing came. (An LRU over the pooled capacity is the reference, not a
strict optimum: a partition of sessions over separate caches can beat it on some streams.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.replay.prompts import BLOCK_TOKENS
from cas_engine.sim.prefix_cache import PrefixCache


@dataclass
class LruBound:
    """See the module docstring. `capacity_tokens`: the pool's total prefix cache."""

    capacity_tokens: int
    block_size: int = BLOCK_TOKENS
    cache: PrefixCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.block_size, self.capacity_tokens)

    def observe(self, tokens: np.ndarray) -> int:
        """The cached prefix of this prompt (tokens) in the pooled LRU; then it is cached."""
        return self.cache.match_and_insert(tokens)

"""Radix-style prefix cache over fixed-size token blocks: an exact LRU, leaves first.

Ownership: one per worker (the prefill side in PD mode, the only side in ``null`` mode). The
worker calls :meth:`PrefixCache.match_and_insert` with each prompt's tokens; the returned number
of cached tokens drives the prefill cost and ``sglang:cache_hit_rate``, so hit rates come from
the traffic (shared multi-turn prefixes hit, new suffixes miss). The replay's bound
(``bench.replay.bound``) runs the same class over the whole pool's capacity.

Structure: each full block is a node keyed by (parent key, block bytes); a prompt's blocks form
a chain from the root, so two prompts share nodes exactly as long as their token prefixes are
equal (the same tree as SGLang's radix cache at block granularity).

Eviction is an exact LRU over blocks: every node of a prompt's chain is used when the prompt
is, and the least recently used node goes first; among the nodes of one prompt, the deepest
goes first. One ordered map holds every node, least recently used first; a prompt moves its
chain to the end deepest first, so a node always comes before its parent (a parent is used
whenever its child is, and later in the same prompt), and the first node is a leaf: evicting
it never leaves a cached node without its prefix.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_ROOT = 0


class PrefixCache:
    """Block prefix cache with a capacity in tokens."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size <= 0 or capacity_tokens < block_size:
            raise ValueError("need block_size > 0 and capacity_tokens >= block_size")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._parent: OrderedDict[int, int] = OrderedDict()  # node -> parent, LRU first
        self.hit_tokens = 0
        self.total_tokens = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens currently held."""
        return len(self._parent) * self.block_size

    def match_and_insert(self, tokens: np.ndarray) -> int:
        """Count the cached prefix of ``tokens`` (in tokens), then cache all its full blocks."""
        bs = self.block_size
        n_blocks = len(tokens) // bs
        raw = tokens[: n_blocks * bs].tobytes()
        width = bs * tokens.itemsize
        parent, hit_blocks = _ROOT, 0
        chain: list[int] = []
        for i in range(n_blocks):
            key = hash((parent, raw[i * width : (i + 1) * width]))
            if key in self._parent:
                hit_blocks += 1  # only a cached node's children can be cached: still matching
            else:
                self._parent[key] = parent
            chain.append(key)
            parent = key
        for key in reversed(chain):  # most recently used, the root end last
            self._parent.move_to_end(key)
        while len(self._parent) > self.capacity_blocks:
            self._parent.popitem(last=False)  # the least recently used node, always a leaf
        hit = hit_blocks * bs
        self.hit_tokens += hit
        self.total_tokens += len(tokens)
        return hit

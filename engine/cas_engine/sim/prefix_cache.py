"""Radix-style prefix cache over fixed-size token blocks, with leaf-first LRU eviction.

Ownership: one per worker (the prefill side in PD mode, the only side in ``null`` mode). The
worker calls :meth:`PrefixCache.match_and_insert` with each prompt's tokens; the returned number
of cached tokens drives the prefill cost and ``sglang:cache_hit_rate``, so hit rates come from
the traffic (shared multi-turn prefixes hit, new suffixes miss).

Structure: each full block is a node keyed by (parent key, block bytes); a prompt's blocks form
a chain from the root, so two prompts share nodes exactly as long as their token prefixes are
equal (the same tree as SGLang's radix cache at block granularity). Only leaves are evicted, least
recently used first, so a cached node's whole prefix always stays cached.
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
        self._children: dict[int, int] = {}  # node key -> number of children
        self._parent: dict[int, int] = {}
        self._leaves: OrderedDict[int, None] = OrderedDict()
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
        parent, hit_blocks, matching = _ROOT, 0, True
        for i in range(n_blocks):
            key = hash((parent, raw[i * width : (i + 1) * width]))
            if key in self._parent:
                if matching:
                    hit_blocks += 1
                self._touch(key)
            else:
                matching = False
                self._add(key, parent)
            parent = key
        self._evict()
        hit = hit_blocks * bs
        self.hit_tokens += hit
        self.total_tokens += len(tokens)
        return hit

    def _touch(self, key: int) -> None:
        if key in self._leaves:
            self._leaves.move_to_end(key)

    def _add(self, key: int, parent: int) -> None:
        self._parent[key] = parent
        self._children[key] = 0
        self._leaves[key] = None
        if parent != _ROOT:
            self._children[parent] += 1
            self._leaves.pop(parent, None)

    def _evict(self) -> None:
        while len(self._parent) > self.capacity_blocks and self._leaves:
            key, _ = self._leaves.popitem(last=False)
            parent = self._parent.pop(key)
            del self._children[key]
            if parent != _ROOT and parent in self._children:
                self._children[parent] -= 1
                if self._children[parent] == 0:
                    self._leaves[parent] = None
                    self._leaves.move_to_end(parent, last=False)

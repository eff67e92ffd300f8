"""Per-instance prefix caches over real prompt block ids, exact as a block-by-block LRU (pure).

Data flow: a session's prompts (prefix-chained block ids: two prompts share ids exactly as far
as their tokens are equal) -> `BlockTrie` (every block id a node, its parent the block before
it) -> each request is (scope, trie, leaf node, blocks) -> the router asks every prefill
instance's `InstanceCache.lookup` how much of the prompt it holds -> the chosen instance's
`reference` makes the request's blocks the most recent -> `Overlap`s give the hit (by tier)
and the reuse times the engine's `cas_engine.prefixreuse` tracker would export.

The cache of one instance is one LRU over (scope, block) keys of ``ghost_blocks`` blocks; its
first ``gpu`` positions are the GPU tier, the next ``host`` the HiCache host tier, the rest
only the engine's ghost map (blocks it remembers the last reference of, no longer cached), as
`bench.hitrate` and the simulator's session-level caches order them. A request references all
its blocks at once; a deeper block is less recent than its ancestors (a radix tree evicts
leaves first), so what an instance holds of a scope is prefix-closed and a prompt hits its
longest cached prefix. It is kept as *entries*: a reference of request ``r`` owns the blocks
of its path at depths ``[lo, hi)`` whose last reference on the instance it was. A later
request of the scope that shares ``k`` blocks with ``r`` takes ``[lo, min(hi, k))`` from it;
eviction trims the oldest entry from its deep end. A Fenwick tree over entries in reference
order gives each entry's position (blocks in newer entries), so a lookup costs one lowest
common ancestor per live entry of the scope on the instance (a few) and a reference
O(log entries). Checked against a block-by-block LRU in tests/unit/test_prefixcache.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I32 = npt.NDArray[np.int32]


class BlockTrie:
    """The prompt blocks of one session (its subagents share its id space) as a tree.

    Node ``x`` is block id ``x`` (ids are small positive integers per session in the Claude
    Code traces; 0 is the virtual root); ``depth[x]`` is the number of blocks on the path to it
    (1 for a prompt's first block). ``head[x]`` is the top of the unbranched chain through
    ``x``: a node starts a chain when its parent has more or fewer than one child."""

    __slots__ = ("depth", "head", "parent")

    def __init__(self, paths: Sequence[npt.NDArray[np.integer]]) -> None:
        top = max((int(p.max()) for p in paths if len(p)), default=0)
        parent = np.zeros(top + 1, dtype=np.int64)
        depth = np.zeros(top + 1, dtype=np.int64)
        seen = np.zeros(top + 1, dtype=bool)
        for p in paths:
            if not len(p):
                continue
            ids = np.asarray(p, dtype=np.int64)
            parent[ids] = np.concatenate(([0], ids[:-1]))
            depth[ids] = np.arange(1, len(ids) + 1)
            seen[ids] = True
        nodes = np.flatnonzero(seen)
        children = np.bincount(parent[nodes], minlength=top + 1)
        single = np.zeros(top + 1, dtype=bool)
        single[nodes] = (parent[nodes] != 0) & (children[parent[nodes]] == 1)
        head = np.where(single, parent, np.arange(top + 1))
        while True:  # pointer jumping: each node's first ancestor-or-self that starts a chain
            up = head[head]
            if np.array_equal(up, head):
                break
            head = up
        # array("i") indexes to Python ints at 4 bytes a node (a list holds int objects)
        self.parent = array("i", parent.astype(np.int32).tobytes())
        self.depth = array("i", depth.astype(np.int32).tobytes())
        self.head = array("i", head.astype(np.int32).tobytes())

    def common(self, u: int, v: int) -> int:
        """Blocks the paths to nodes ``u`` and ``v`` share (the depth of their lowest common
        ancestor): climb chain by chain, the deeper chain head first."""
        head, parent, depth = self.head, self.parent, self.depth
        while True:
            hu, hv = head[u], head[v]
            if hu == hv:
                return min(depth[u], depth[v])
            if depth[hu] >= depth[hv]:
                u = parent[hu]
            else:
                v = parent[hv]


@dataclass(eq=False)
class _Entry:
    scope: str
    trie: BlockTrie
    leaf: int
    lo: int  # owned depths [lo, hi) of the path to `leaf`
    hi: int
    time: float
    slot: int


@dataclass(frozen=True)
class Overlap:
    """Blocks of a looked-up prompt the instance holds from one entry: depths ``[lo, hi)``,
    ``front`` blocks more recent than the shallowest of them, last referenced at ``time``."""

    slot: int
    lo: int
    hi: int
    front: int
    time: float

    @property
    def blocks(self) -> int:
        return self.hi - self.lo

    def within(self, capacity: int) -> int:
        """Of these blocks, those in the first ``capacity`` LRU positions (cached there)."""
        return max(0, min(self.hi - self.lo, capacity - self.front))


class _Fenwick:
    """Prefix sums over a growable array of non-negative counts."""

    def __init__(self) -> None:
        self.tree = [0] * 1025

    def add(self, i: int, value: int) -> None:
        if i + 1 >= len(self.tree):
            self._grow(2 * (i + 1))
        i += 1
        tree, n = self.tree, len(self.tree)
        while i < n:
            tree[i] += value
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of counts [0, i)."""
        total, tree = 0, self.tree
        i = min(i, len(tree) - 1)
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def _grow(self, size: int) -> None:
        old = [self.prefix(i + 1) - self.prefix(i) for i in range(len(self.tree) - 1)]
        self.tree = [0] * (size + 1)
        for i, v in enumerate(old):
            if v:
                self.add(i, v)


class InstanceCache:
    """One prefill instance: its LRU of prompt blocks and its engine's ghost map (module doc).

    ``ghost_blocks`` bounds the whole LRU (the ghost map's reach:
    ``DEFAULT_GHOST_ENTRIES x DEFAULT_SAMPLE_RATE`` blocks in an engine)."""

    def __init__(self, ghost_blocks: int) -> None:
        self.ghost_blocks = ghost_blocks
        self.total = 0  # blocks held, cache and ghost
        self._entries: list[_Entry | None] = []
        self._owned = _Fenwick()
        self._oldest = 0
        self._by_scope: dict[str, list[_Entry]] = {}

    def holds(self, scope: str) -> bool:
        return scope in self._by_scope

    def lookup(self, scope: str, trie: BlockTrie, leaf: int) -> list[Overlap]:
        """What this instance holds of the prompt ending at ``leaf``, entry by entry."""
        found = []
        for e in self._by_scope.get(scope, ()):
            shared = min(e.hi, trie.common(e.leaf, leaf))
            if shared > e.lo:
                front = self.total - self._owned.prefix(e.slot + 1)
                found.append(Overlap(e.slot, e.lo, shared, front, e.time))
        return found

    def reference(
        self,
        scope: str,
        trie: BlockTrie,
        leaf: int,
        blocks: int,
        now: float,
        overlaps: Sequence[Overlap],
    ) -> None:
        """The request ending at ``leaf`` (``blocks`` deep) was routed here at ``now``:
        ``overlaps`` (its `lookup` here) move to a new, most recent entry with the rest of
        its blocks; then the oldest blocks beyond ``ghost_blocks`` go."""
        moved = 0
        for ov in overlaps:
            e = self._entries[ov.slot]
            assert e is not None
            moved += ov.hi - ov.lo
            self._owned.add(e.slot, -(ov.hi - ov.lo))
            e.lo = ov.hi
            if e.lo >= e.hi:
                self._drop(e)
        if blocks > 0:
            slot = len(self._entries)
            e = _Entry(scope, trie, leaf, 0, blocks, now, slot)
            self._entries.append(e)
            self._owned.add(slot, blocks)
            self._by_scope.setdefault(scope, []).append(e)
        self.total += blocks - moved
        self._evict()

    def _drop(self, e: _Entry) -> None:
        self._entries[e.slot] = None
        live = self._by_scope[e.scope]
        live.remove(e)
        if not live:
            del self._by_scope[e.scope]

    def _evict(self) -> None:
        while self.total > self.ghost_blocks:
            e = self._entries[self._oldest]
            if e is None:
                self._oldest += 1
                continue
            cut = min(e.hi - e.lo, self.total - self.ghost_blocks)
            e.hi -= cut
            self._owned.add(e.slot, -cut)
            self.total -= cut
            if e.hi <= e.lo:
                self._drop(e)
                self._oldest += 1

"""The fleet simulator's per-instance prefix caches over real block ids
(bench.fleetsim.prefixcache) against a block-by-block LRU (issue 39, part 3).

Guards: the entry-based cache (entries owning depth ranges, a Fenwick tree for positions, one
lowest common ancestor per entry) must give, for any routing of prefix-chained sessions over
several instances, exactly the hits a per-instance OrderedDict LRU over (scope, block) keys
gives at every tier capacity, and exactly the reuse times a ghost map of last references would
export; the trie's common prefix must equal the compared block lists'."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from bench.fleetsim.prefixcache import BlockTrie, InstanceCache


def _sessions(n: int, seed: int) -> list[list[list[int]]]:
    """Per session, its prompts' block ids: growing by a few blocks, sometimes cut back to a
    shorter prefix (compaction) or branching from an earlier prompt (a subagent)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        next_id, chain, prompts = 10, [1, 2, 3], []
        for _turn in range(int(rng.integers(3, 12))):
            r = rng.random()
            if prompts and r < 0.15:
                chain = chain[: max(1, len(chain) // 2)]
            elif prompts and r < 0.25:
                chain = list(prompts[int(rng.integers(len(prompts)))])[:3]
            grow = int(rng.integers(0, 6))
            chain = chain + list(range(next_id, next_id + grow))
            next_id += grow
            prompts.append(list(chain))
        out.append(prompts)
    return out


def _brute(keys: list[tuple[str, int]], lru: OrderedDict, cap: int) -> int:
    n = 0
    while n < len(keys) and keys[n] in lru and _position(lru, keys[n]) < cap:
        n += 1
    return n


def _position(lru: OrderedDict, key: object) -> int:
    """Blocks more recent than ``key`` (0: the most recent)."""
    return len(lru) - 1 - list(lru).index(key)


def test_trie_common_prefix_equals_the_compared_block_lists() -> None:
    """The lowest common ancestor climb (chain by chain) must give the common prefix length
    of any two prompts of a session, branches and compactions included."""
    for prompts in _sessions(20, seed=4):
        trie = BlockTrie([np.array(p) for p in prompts])
        for a in prompts:
            for b in prompts:
                k = 0
                while k < min(len(a), len(b)) and a[k] == b[k]:
                    k += 1
                assert trie.common(a[-1], b[-1]) == k


@pytest.mark.parametrize("ghost", [12, 40, 10_000])
def test_hits_and_reuse_times_equal_a_block_by_block_lru(ghost: int) -> None:
    """Random routing of interleaved sessions over three instances: per request and instance
    the cached prefix within a GPU and a GPU + host capacity, and the reuse time of every
    block seen before, as a per-instance OrderedDict LRU of ``ghost`` blocks (leaf-first)."""
    rng = np.random.default_rng(7)
    sessions = _sessions(12, seed=5)
    tries = [BlockTrie([np.array(p) for p in s]) for s in sessions]
    queue = [(s, k) for s, prompts in enumerate(sessions) for k in range(len(prompts))]
    order = sorted(queue, key=lambda x: (x[1] + rng.random() * 3, x[0]))  # sessions interleave
    caches = [InstanceCache(ghost) for _ in range(3)]
    lrus: list[OrderedDict] = [OrderedDict() for _ in range(3)]
    last: list[dict] = [{} for _ in range(3)]
    for now, (s, k) in enumerate(order):
        path = sessions[s][k]
        scope = f"s{s}"
        keys = [(scope, b) for b in path]
        for i in range(3):
            overlaps = caches[i].lookup(scope, tries[s], path[-1])
            for cap in (2, 7, ghost):
                got = sum(ov.within(cap) for ov in overlaps)
                assert got == _brute(keys, lrus[i], cap), (now, i, cap)
        i = int(rng.integers(3))
        overlaps = caches[i].lookup(scope, tries[s], path[-1])
        reuse = sorted((float(now) - ov.time, ov.blocks) for ov in overlaps)
        expected: dict[float, int] = {}
        for key in keys:
            if key in lrus[i]:
                gap = float(now) - last[i][key]
                expected[gap] = expected.get(gap, 0) + 1
        merged: dict[float, int] = {}
        for gap, n in reuse:
            merged[gap] = merged.get(gap, 0) + n
        assert merged == expected
        caches[i].reference(scope, tries[s], path[-1], len(path), float(now), overlaps)
        for key in reversed(keys):  # deepest first: the first block ends most recent
            lrus[i][key] = None
            lrus[i].move_to_end(key)
            last[i][key] = float(now)
        while len(lrus[i]) > ghost:
            lrus[i].popitem(last=False)
        assert caches[i].total == len(lrus[i])

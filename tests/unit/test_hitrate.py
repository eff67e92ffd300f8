"""python -m bench.hitrate: its LRU replay against a block-by-block LRU, its measurement of
what the engines export, and the issue-39 bars on a slice of the real sessions.

Guards: the Mattson-style replay (one Fenwick pass giving every capacity) must equal a plain
radix-style LRU; the hit-rate model fed only with the measured histogram must track that
replay on real sessions (mean error <= 0.03, no cell off by more than 0.10, the capacity for
50% and 90% hits within 25%), which the previous model (Che's approximation) did not."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from bench import hitrate as h
from bench.traces import parse_claude_session
from tests.real_traces import CLAUDE_SESSIONS, require


def _synthetic_sessions(n: int, seed: int) -> list[dict]:
    """Sessions whose prompts grow by a few blocks per turn, sometimes restart from a shorter
    prefix (compaction), with one subagent sharing its root's first blocks."""
    rng = np.random.default_rng(seed)
    docs = []
    for s in range(n):
        next_id, chain, t, reqs = 1000, [1, 2, 3], 0.0, []
        for turn in range(int(rng.integers(3, 9))):
            if turn and rng.random() < 0.2:
                chain = chain[: max(1, len(chain) // 2)]
            grow = int(rng.integers(1, 6))
            chain = chain + list(range(next_id, next_id + grow))
            next_id += grow
            t += float(rng.exponential(20.0)) if turn else 0.0
            reqs.append(
                {"t": t, "type": "n", "in": 64 * len(chain) + 10, "out": 5, "hash_ids": chain}
            )
            if turn == 1:
                sub_chain = [1, 2, 5000, 5001]
                reqs.append(
                    {
                        "t": t + 1.0,
                        "type": "subagent",
                        "agent_id": "a",
                        "requests": [
                            {"t": 0.0, "in": 300, "out": 5, "hash_ids": sub_chain},
                            {"t": 4.0, "in": 400, "out": 5, "hash_ids": [*sub_chain, 5002]},
                        ],
                    }
                )
        docs.append({"id": f"s{s}", "block_size": 64, "requests": reqs})
    return docs


def _brute_force(o: h.Overlay, keys: list[list[tuple[str, int]]], capacity_blocks: int) -> float:
    """A radix-style LRU block by block: a request hits its longest cached prefix, then all its
    blocks become most recent, ancestors ahead of descendants (leaf-first eviction)."""
    lru: OrderedDict[tuple[str, int], None] = OrderedDict()
    hit = total = 0
    for i, blocks in enumerate(keys):
        n = 0
        while n < len(blocks) and blocks[n] in lru:
            n += 1
        if o.times[i] >= 0 and o.returning[i]:
            hit += n * h.BLOCK_SIZE
            total += int(o.prompt[i])
        for key in reversed(blocks):  # deepest first: the first block ends most recent
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total


def _keys_in_replay_order(
    sessions: list, compacts: list[h.Compact], o: h.Overlay, live: int, seed: int
):
    """Every request's block keys (scope, id), in the overlay's request order."""
    placements, horizon, _ = h._place(compacts, live, seed)
    rows = []
    for instance, (start, index) in enumerate(placements):
        placed = sorted(
            (
                (off + r.t, k, r)
                for k, (off, member) in enumerate(sessions[index].family())
                for r in member.requests
            ),
            key=lambda x: (x[0], x[1]),
        )
        for at, _, r in placed:
            if start + at < horizon:
                rows.append((start + at, [(f"{instance}", int(b)) for b in r.block_ids]))
    rows.sort(key=lambda x: x[0])  # stable, as the overlay's argsort
    assert np.allclose([t for t, _ in rows], o.times)
    return [k for _, k in rows]


@pytest.mark.parametrize("capacity_blocks", [4, 12, 40, 400])
def test_the_replay_equals_a_block_by_block_lru(capacity_blocks: int) -> None:
    sessions = [parse_claude_session(d) for d in _synthetic_sessions(12, seed=5)]
    compacts = [h.compact(s, 1.0, sample_rate=1) for s in sessions]
    o = h.overlay(compacts, live=4, seed=2)
    keys = _keys_in_replay_order(sessions, compacts, o, 4, 2)
    fast = h.replay_hits(o, [capacity_blocks * h.BLOCK_SIZE])[0]
    assert fast == pytest.approx(_brute_force(o, keys, capacity_blocks), abs=1e-12)


def test_groups_are_runs_of_blocks_last_referenced_by_the_same_request() -> None:
    """Turn 3 reuses turn 2's blocks and the first block turn 1 left; its new blocks are a
    first-seen group."""
    doc = {
        "requests": [
            {"t": 0.0, "in": 128, "out": 1, "hash_ids": [1, 2]},
            {"t": 5.0, "in": 192, "out": 1, "hash_ids": [1, 3, 4]},
            {"t": 9.0, "in": 320, "out": 1, "hash_ids": [1, 3, 4, 5, 6]},
        ]
    }
    c = h.compact(parse_claude_session(doc), 1.0, sample_rate=1)
    assert c.group_request.tolist() == [0, 1, 1, 2, 2]
    assert c.group_prev.tolist() == [-1, 0, -1, 1, -1]
    assert c.group_size.tolist() == [2, 1, 2, 3, 2]
    assert c.returning.tolist() == [False, True, True]


def test_the_measurement_is_what_the_engines_would_export() -> None:
    """Reuse times per group into the token-weighted histogram, first-seen tokens, requests,
    request sizes and returning-request prompt tokens, over the window only."""
    doc = {
        "requests": [
            {"t": 0.0, "in": 128, "out": 1, "hash_ids": [1, 2]},
            {"t": 25.0, "in": 200, "out": 3, "hash_ids": [1, 2, 3]},
        ]
    }
    c = h.compact(parse_claude_session(doc), 1.0, sample_rate=1)
    o = h.Overlay(
        times=c.times,
        prompt=c.prompt,
        blocks=c.blocks,
        returning=c.returning,
        outputs=c.output,
        cycle_gap=np.array([0.0, 25.0]),
        group_request=c.group_request,
        group_prev=c.group_prev,
        group_size=c.group_size,
        group_sampled=c.group_sampled,
        position=h.stack_positions(c.blocks, c.group_request, c.group_prev, c.group_size),
        window_s=100.0,
        rate=0.01,
    )
    m = h.measure(o, sample_rate=1)
    p = m.profile  # quantised as the operator's planner sees it (shares to 0.005)
    assert p.tokens_per_request == pytest.approx((128 + 192) / 2)
    assert p.seen_share == pytest.approx(128 / (128 + 192))  # 2 reused of 5 referenced blocks
    assert dict(p.reused)[20] == 0.0 and dict(p.reused)[30] == pytest.approx(128 / 320)
    assert p.returning_share == pytest.approx(200 / 320, abs=0.01)  # to 0.01
    assert p.size_biased_tokens == pytest.approx((128**2 + 192**2) / 320, rel=0.05)  # 2 digits
    assert m.first_turn_fraction == 0.5 and m.request_rate == pytest.approx(0.02)


def test_the_crossing_reads_the_capacity_between_points() -> None:
    assert h.crossing([1e6, 4e6], [0.2, 0.8], 0.5) == pytest.approx(2e6)
    assert h.crossing([1e6, 4e6], [0.6, 0.8], 0.5) == 1e6
    assert h.crossing([1e6, 4e6], [0.1, 0.2], 0.5) is None


SLICE_SESSIONS = 80


def test_the_model_holds_the_issue_bars_on_real_sessions(tmp_path: Path) -> None:
    """A slice of `python -m bench.hitrate` (the first 80 real sessions, 10 and 25 live
    sessions, think times x1 and x0.25, one seed): the new model within the bars, the old one
    (Che's approximation from rate, lengths, first-turn share and cycle) outside them."""
    path = require(CLAUDE_SESSIONS)
    out = tmp_path / "hitrate.json"
    h.main(
        [
            "--sessions", str(path), "--out", str(out), "--limit", str(SLICE_SESSIONS),
            "--live", "10,25", "--capacities-m", "0.5,1,2,4,8,16", "--seeds", "1",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["think_scale"] for r in rows} == {1.0, 0.25} and len(rows) == 2 * 2 * 6
    summary = result["summary"]
    new, old = summary["model"], summary["old_model"]
    assert new["mean_abs_error"] <= 0.03 and new["worst_abs_error"] <= 0.10, new
    low, high = summary["model_capacity_ratio_range"]
    assert low >= 0.75 and high <= 1.25, summary["crossings"]
    assert old["worst_abs_error"] > 0.10 or summary["old_model_capacity_ratio_range"][1] > 1.25

"""The trace reader (bench.traces): the three formats on small files made here, the overlays,
and a few real sessions from ../shared/traces (issue 39, part 1).

Each test names what it guards: a subagent's blocks in its root's id space, a tarball read
like a folder without unpacking, think-time scaling that keeps the order, seeded overlays."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bench.traces import (
    SessionPool,
    TraceFormatError,
    azure_arrivals,
    burst_starts,
    fleet_requests,
    mean_duration_s,
    mooncake_arrivals,
    placement_order,
    poisson_starts,
    ramp_starts,
    rate_for_live_sessions,
    read_sessions,
    think_scaled,
    trace_starts,
)
from tests.real_traces import AZURE, CLAUDE_SESSIONS, MOONCAKE, require


def _req(t: float, n_in: int, ids: list[int], think: float = 0.0, out: int = 10) -> dict:
    return {
        "t": t,
        "type": "n",
        "model": "m",
        "in": n_in,
        "out": out,
        "hash_ids": ids,
        "think_time": think,
        "api_time": 2.0,
    }


def _session(key: str) -> dict:
    sub = {
        "t": 12.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "requests": [_req(0.0, 200, [1, 90]), _req(5.0, 300, [1, 90, 91, 92], think=3.0)],
    }
    return {
        "id": key,
        "block_size": 64,
        "requests": [
            _req(0.0, 140, [1, 2]),
            sub,
            _req(10.0, 270, [1, 2, 3, 4], think=8.0),
            _req(40.0, 300, [1, 2, 3, 4], think=28.0),
        ],
    }


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "sessions"
    d.mkdir()
    for key in ("trace_a", "trace_b"):
        (d / f"{key}.json").write_text(json.dumps(_session(key)))
    return d


@pytest.fixture
def tarball(folder: Path, tmp_path: Path) -> Path:
    path = tmp_path / "sessions.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(folder, arcname=".")
    return path


def test_a_subagent_is_its_own_session_in_its_roots_block_id_space(folder: Path) -> None:
    """Ids are per root session: a subagent shares them (block 1 is its parent's block 1)."""
    root = next(read_sessions(folder))
    assert root.key == "trace_a" and root.root == "trace_a"
    assert [r.t for r in root.requests] == [0.0, 10.0, 40.0]
    (sub,) = root.subagents
    assert sub.key == "trace_a/agent_001" and sub.root == "trace_a" and sub.start_s == 12.0
    assert list(sub.requests[1].block_ids) == [1, 90, 91, 92]
    family = list(root.family())
    assert [(at, s.key) for at, s in family] == [(0.0, "trace_a"), (12.0, "trace_a/agent_001")]


def test_request_fields_give_the_replay_what_it_needs(folder: Path) -> None:
    """Block ids with their block size and the fresh tail (prompt past the last full block)."""
    first = next(read_sessions(folder)).requests[0]
    assert first.block_size == 64 and first.block_tokens == 128
    assert first.fresh_tail_tokens == 140 - 128
    assert first.input_tokens == 140 and first.output_tokens == 10 and first.api_s == 2.0


def test_a_tarball_reads_like_the_folder_without_unpacking(folder: Path, tarball: Path) -> None:
    from_dir = [(s.key, [len(r.block_ids) for r in s.requests]) for s in read_sessions(folder)]
    from_tar = [(s.key, [len(r.block_ids) for r in s.requests]) for s in read_sessions(tarball)]
    assert sorted(from_tar) == from_dir
    assert not list(tarball.parent.glob("trace_*.json"))  # nothing was unpacked


def test_a_file_that_is_not_a_session_is_refused_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"no": "requests"}))
    with pytest.raises(TraceFormatError, match=r"x\.json"):
        list(read_sessions(bad))


def test_session_pool_gives_any_session_back_from_compressed_json(tarball: Path) -> None:
    pool = SessionPool.load(tarball)
    assert sorted(pool.keys) == ["trace_a", "trace_b"] and len(pool) == 2
    assert pool.session("trace_b").requests[2].t == 40.0


def test_think_scaling_shortens_pauses_and_moves_the_subagent_with_its_parent(folder: Path) -> None:
    """x0.25: the 8 s and 28 s pauses become 2 s and 7 s; a subagent started at 12 s (after the
    10 s request, which lost 6 s) starts at 6 s; its own 3 s pause becomes 0.75 s."""
    root = think_scaled(next(read_sessions(folder)), 0.25)
    assert [r.t for r in root.requests] == [0.0, 4.0, 13.0]
    assert [r.think_s for r in root.requests] == [0.0, 2.0, 7.0]
    (sub,) = root.subagents
    assert sub.start_s == 6.0 and [r.t for r in sub.requests] == [0.0, 2.75]
    longer = think_scaled(next(read_sessions(folder)), 2.0)
    assert [r.t for r in longer.requests] == [0.0, 18.0, 76.0]


def test_think_scaling_never_reorders_overlapping_requests() -> None:
    """A think time longer than the gap to the previous request (parallel requests) is cut by
    at most that gap."""
    from bench.traces import parse_claude_session

    doc = {"requests": [_req(0.0, 64, [1]), _req(1.0, 64, [1], think=30.0)]}
    scaled = think_scaled(parse_claude_session(doc), 0.0)
    assert [r.t for r in scaled.requests] == [0.0, 0.0]


def test_fleet_stream_is_time_ordered_with_one_scope_per_placement(folder: Path) -> None:
    """Two placements of the same session are two sessions: different scopes (block keys)."""
    sessions = list(read_sessions(folder))
    stream = list(fleet_requests(sessions, np.array([0.0, 5.0, 7.0]), seed=3))
    times = [fr.time_s for fr in stream]
    assert times == sorted(times) and len(stream) == 3 * 5
    scopes = {fr.scope for fr in stream}
    assert len(scopes) == 3
    subs = [fr for fr in stream if "agent_001" in fr.session]
    assert {fr.scope for fr in subs} == scopes  # a subagent keeps its root's scope
    firsts = [fr for fr in stream if fr.turn == 0]
    assert len(firsts) == 6  # 3 roots + 3 subagents start a session each


def test_fleet_stream_loads_sessions_lazily_by_key(tarball: Path) -> None:
    pool = SessionPool.load(tarball)
    loaded: list[str] = []

    def load(key: str):  # type: ignore[no-untyped-def]
        loaded.append(key)
        return pool.session(key)

    stream = fleet_requests(pool.keys, np.array([0.0, 100.0]), seed=1, load=load)
    next(stream)
    assert len(loaded) == 1  # the second session is not loaded before its start
    rest = list(stream)
    assert len(loaded) == 2 and len(rest) == 9


def test_placement_uses_every_session_before_repeating_one() -> None:
    order = placement_order(5, 12, seed=7)
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:10]) == list(range(5))
    assert order == placement_order(5, 12, seed=7) != placement_order(5, 12, seed=8)


def test_poisson_starts_are_seeded_and_at_the_rate() -> None:
    a = poisson_starts(2.0, 5000.0, seed=1)
    assert np.array_equal(a, poisson_starts(2.0, 5000.0, seed=1))
    assert abs(len(a) / 5000.0 - 2.0) < 0.1 and (np.diff(a) >= 0).all()
    assert rate_for_live_sessions(100, 3600.0) == pytest.approx(100 / 3600.0)


def test_a_ramp_starts_more_sessions_at_its_high_end() -> None:
    ramp = ramp_starts(0.1, 1.0, 10_000.0, seed=2)
    early, late = (ramp < 5000).sum(), (ramp >= 5000).sum()
    assert late > 2.0 * early  # mean rates 0.325 and 0.775
    assert abs(len(ramp) - 0.55 * 10_000) < 300  # the mean rate of the ramp


def test_a_burst_adds_starts_inside_its_window_only() -> None:
    base = poisson_starts(0.5, 1000.0, seed=4)
    burst = burst_starts(0.5, 1000.0, seed=4, burst_at_s=400.0, burst_s=50.0, burst_rate=10.0)
    inside = (burst >= 400) & (burst < 450)
    assert inside.sum() > 400 and len(burst[~inside]) == len(base[(base < 400) | (base >= 450)])


def test_trace_starts_follow_the_arrivals_at_the_asked_rate() -> None:
    arrivals = np.array([0.0, 1.0, 1.0, 3.0])
    starts = trace_starts(arrivals, rate=4.0, horizon_s=3.0)
    assert len(starts) == 12 and np.allclose(starts[:4], [0.0, 0.25, 0.25, 0.75])
    assert np.array_equal(trace_starts(arrivals), arrivals)


def test_mooncake_lines_are_requests_in_one_shared_block_space(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sessions = list(read_sessions(path))
    assert {s.root for s in sessions} == {"mooncake"} and sessions[1].start_s == 3.0
    assert sessions[0].requests[0].block_size == 512
    assert list(sessions[0].requests[0].block_ids) == [0, 1]  # the partial third block dropped
    assert sessions[0].requests[0].fresh_tail_tokens == 1100 - 1024
    assert list(mooncake_arrivals(path)) == [0.0, 3.0]


def test_azure_rows_are_requests_without_blocks(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:05.0319600,3180,8\n"
    )
    sessions = list(read_sessions(path))
    assert [s.requests[0].input_tokens for s in sessions] == [4808, 3180]
    assert sessions[0].requests[0].fresh_tail_tokens == 4808
    assert azure_arrivals(path)[1] == pytest.approx(1.052, abs=1e-6)


def test_real_claude_sessions_stream_from_the_tarball() -> None:
    """A few real sessions: ids prefix-chained per session, times in order, tails short."""
    path = require(CLAUDE_SESSIONS)
    sessions = []
    for s in read_sessions(path):
        sessions.append(s)
        if len(sessions) == 5:
            break
    for s in sessions:
        assert s.requests and s.root == s.key
        times = [r.t for r in s.requests]
        assert times == sorted(times)
        for r in s.requests:
            assert 0 <= r.fresh_tail_tokens < r.block_size
        a, b = s.requests[0].block_ids, s.requests[1].block_ids
        assert a[0] == b[0]  # a returning turn shares its session's first block
    assert mean_duration_s(sessions, 0.25) < mean_duration_s(sessions)


def test_real_mooncake_and_azure_arrivals_read() -> None:
    moon = mooncake_arrivals(require(MOONCAKE))
    assert len(moon) == 12_031 and 3000 < moon[-1] < 4000
    azure = azure_arrivals(require(AZURE))
    assert len(azure) == 8_819 and (np.diff(azure) >= 0).all()


def test_in_memory_tarball_members_need_no_names_on_disk(tmp_path: Path) -> None:
    """A member inside a sub-folder of the archive is read by its file name."""
    path = tmp_path / "nested.tar.gz"
    raw = json.dumps(_session("trace_c")).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("deep/dir/trace_c.json")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    assert [s.key for s in read_sessions(path)] == ["trace_c"]

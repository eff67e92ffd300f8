"""The replay client (bench.replay.client) against one sim engine in-process (issue 40).

Guards: a bound that does not count what the engines count (one engine holding the pool's
whole capacity must hit exactly what the bound says, evictions included: the same prompts,
the same tokens, the same exact LRU), prompts the engine tokenizes to another length,
requests sent before the previous one of the session was answered and its think time passed,
a subagent started before its parent's request, and a duration or turn bound not kept."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from bench.replay.client import Replay, ReplayConfig
from bench.replay.prompts import Scale
from bench.replay.sources import claude_source
from bench.traces import SessionPool
from cas_engine.sim.config import parse_args
from cas_engine.sim.server import SimServer
from cas_engine.sim.worker import SimWorker

pytestmark = pytest.mark.timeout(120)
MODEL = "replay-sim"


def _req(t: float, n_in: int, ids: list[int], think: float = 0.0) -> dict[str, Any]:
    return {"t": t, "type": "n", "model": "m", "in": n_in, "out": 3, "hash_ids": ids,
            "think_time": think, "api_time": 1.0}  # fmt: skip


def _write_session(folder: Path, key: str, requests: list[dict[str, Any]]) -> None:
    doc = {"id": key, "block_size": 64, "requests": requests}
    (folder / f"{key}.json").write_text(json.dumps(doc))


def _growing(key: str, turns: int, think: float) -> list[dict[str, Any]]:
    """A session whose prompt grows by 6 blocks a turn, with one rewind (turn 4 goes back to
    turn 2's prefix and branches), and a subagent after the first request."""
    out: list[dict[str, Any]] = []
    for turn in range(turns):
        n = 6 * (turn + 1)
        ids = list(range(1, n + 1)) if turn != 4 else [*list(range(1, 13)), 700, 701]
        out.append(_req(10.0 * turn, 64 * len(ids) + 20, ids, think=think if turn else 0.0))
    sub = {
        "t": 3.0,
        "type": "subagent",
        "agent_id": "a1",
        "requests": [_req(0.0, 64 * 3, [1, 2, 900]), _req(2.0, 64 * 4, [1, 2, 900, 901])],
    }
    return [out[0], sub, *out[1:]]  # fmt: skip


@pytest.fixture
async def engine_url() -> AsyncIterator[tuple[str, SimWorker]]:
    cfg = parse_args(["--sim-speedup", "50", "--served-model-name", MODEL,
                      "--sim-kv-capacity", "1600"])  # fmt: skip
    worker = SimWorker(cfg)
    await worker.start()
    server = TestServer(SimServer(cfg, worker).app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), worker
    finally:
        await server.close()
        await worker.stop()


def _config(url: str, **kw: Any) -> ReplayConfig:
    base: dict[str, Any] = {
        "url": url,
        "model": MODEL,
        "pool_capacity_tokens": 1600,
        "scale": Scale(tokens=1, think=0.01),
    }
    return ReplayConfig(**{**base, **kw})  # fmt: skip


async def test_one_engine_of_the_pools_capacity_hits_exactly_the_bound(
    engine_url: tuple[str, SimWorker], tmp_path: Path
) -> None:
    """The engine's cached tokens (usage) equal the bound's hits request by request, with
    evictions (1,600 tokens hold 25 blocks; the prompts reach 48) and a rewind."""
    url, worker = engine_url
    _write_session(tmp_path, "s", _growing("s", 8, think=5.0))
    replay = Replay(_config(url), claude_source(SessionPool.load(tmp_path), 0.0, 1, 1))
    await replay.run()
    summary = replay.snapshot()
    assert summary["errors"] == 0 and summary["requests"] == 10, summary
    assert summary["token_mismatches"] == 0
    assert [o.cached_tokens for o in replay.outcomes] == [o.bound_hit for o in replay.outcomes]
    assert summary["ratio"] == 1.0 and 0 < summary["achieved_hit_rate"] < 1
    assert worker.cache.hit_tokens == summary["cached_tokens"]


async def test_requests_wait_for_the_answer_and_the_scaled_think_time(
    engine_url: tuple[str, SimWorker], tmp_path: Path
) -> None:
    url, _ = engine_url
    _write_session(tmp_path, "s", _growing("s", 4, think=20.0))
    replay = Replay(
        _config(url, scale=Scale(tokens=1, think=0.01)),
        claude_source(SessionPool.load(tmp_path), 0.0, 1, 1),
    )
    await replay.run()
    parent = [o for o in replay.outcomes if o.expected_tokens > 300]  # the subagent's are small
    parent.sort(key=lambda o: o.sent_s)
    for before, after in itertools.pairwise(parent):
        assert after.sent_s >= before.sent_s + before.latency_s + 0.2 - 0.02, (before, after)
    first_sub = min((o for o in replay.outcomes if o.expected_tokens <= 300),
                    key=lambda o: o.sent_s)  # fmt: skip
    gap = 3.0 - 0.0 - 1.0  # the subagent starts 3 s in, after the parent's 1 s answer
    assert first_sub.sent_s >= parent[0].sent_s + parent[0].latency_s + gap * 0.01 - 0.02


async def test_the_turn_and_duration_bounds_hold(
    engine_url: tuple[str, SimWorker], tmp_path: Path
) -> None:
    url, _ = engine_url
    _write_session(tmp_path, "s", _growing("s", 8, think=50.0))
    pool = claude_source(SessionPool.load(tmp_path), 0.0, 1, 1)
    turns = Replay(_config(url, max_turns=2), pool)
    await turns.run()
    assert turns.snapshot()["requests"] == 2 + 2  # two of the parent's, two of the subagent's
    timed = Replay(_config(url, scale=Scale(tokens=1, think=1.0), duration_s=1.0), pool)
    await timed.run()
    assert timed.elapsed_s() < 1.5  # it stopped at once: the next think time ends past 1 s
    assert 1 <= timed.snapshot()["requests"] <= 3

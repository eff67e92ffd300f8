"""`make run --trace`'s replays (e2e.traffic.replayload) against one sim engine in-process
(issue 40).

Guards: a replay started before its fleet answers (the first requests would all fail and the
view would show errors the fleet never made), a fleet whose replay never starts once it does
answer, a view line without the achieved hit rate beside the bound, and `stop()` raising
once a replay had run out (its event loop closed: `make run --trace` crashed on exit)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.replay.prompts import Scale
from bench.replay.sources import claude_source
from bench.traces import SessionPool
from cas_engine.sim.worker import SimWorker
from e2e.traffic.replayload import TraceReplays, replay_line
from tests.engine.test_replay_client import MODEL, _growing, _write_session
from tests.engine.test_replay_client import engine_url as engine_url  # the fixture


async def test_the_replay_starts_once_the_fleet_answers_and_the_view_shows_the_bound(
    engine_url: tuple[str, SimWorker], tmp_path: Path
) -> None:
    url, _ = engine_url
    _write_session(tmp_path, "s", _growing("s", 8, think=5.0))
    asked: list[str] = []

    def router_url(name: str) -> str | None:
        asked.append(name)
        return url if len(asked) > 1 else None  # not serving at the first look

    replays = TraceReplays(
        claude_source(SessionPool.load(tmp_path), 0.0, 1, 1), {"fleet": MODEL},
        {"fleet": 1600}, router_url, Scale(tokens=1, think=0.01),
    ).start()  # fmt: skip
    summary: dict[str, Any] = {}
    try:
        for _ in range(300):  # the engine serves on this loop: wait without blocking it
            summary = replays.summaries().get("fleet", {})
            if summary.get("sessions_finished") == 1:
                break
            await asyncio.sleep(0.05)
    finally:
        replays.stop()
    assert asked == ["fleet", "fleet"]
    assert summary["requests"] == 10 and summary["errors"] == 0, summary
    assert summary["ratio"] == 1.0  # one engine of the pool's capacity: exactly the bound
    line = replay_line(summary)
    rate, bound = f"{summary['achieved_hit_rate']:.1%}", f"{summary['bound_hit_rate']:.1%}"
    assert f"hit {rate} of bound {bound}" in line and "errors 0" in line, line

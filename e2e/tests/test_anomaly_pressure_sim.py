"""Prefill starvation on real engine processes -> a prefill scale-up hint, and not when balanced.

A PD sim fleet behind the real SGLang router: one prefill made slow (few tokens per second) under
long coding-agent prompts queues requests while both decodes idle - the skewed P:D ratio the
production report used to reproduce its anomalies. The observe layer reads the engines' real
queue gauges; the planner must ask for one more prefill within the ratio bounds, and must not
when the same fleet runs with a fast prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas_engine.sim.fleet import Fleet, router_available
from cas_operator.autoscale.controller import (
    PoolCounts,
    PressureState,
    ScaleBounds,
    ScaleOutcome,
    suggest_scale,
)
from cas_operator.observe import PodTarget, ScrapeSource
from cas_operator.observe.types import PodView
from e2e.traffic.simload import LoadStats, steady_traffic

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(150),
    pytest.mark.slow,
]
COUNTS = PoolCounts(prefill=1, decode=2, prefill_ready=1, decode_ready=2)
BOUNDS = ScaleBounds(ratio_min=0.25, ratio_max=2.0)


def targets(fleet: Fleet) -> list[PodTarget]:
    out = []
    for role, urls in (("prefill", fleet.prefill_urls), ("decode", fleet.decode_urls)):
        for i, url in enumerate(urls):
            host, port = url.removeprefix("http://").split(":")
            out.append(PodTarget(f"{role}-{i}", role, "ns", host, int(port)))
    return out


@pytest.fixture(params=["slow", "fast"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Fleet]]:
    tps = "3000" if request.param == "slow" else "5000000"
    f = Fleet(prefills=1, decodes=2, speedup=20.0, log_dir=tmp_path / "fleet",
              prefill_args=[["--sim-prefill-tps", tps]])  # fmt: skip
    f.start()
    try:
        yield request.param, f
    finally:
        f.stop()


async def watch(fleet: Fleet, ticks: int) -> list[ScaleOutcome]:
    """Long prompts at concurrency 12; one suggest_scale per second on scraped gauges."""
    stop, stats = asyncio.Event(), LoadStats()
    prompt = "def handler(request):\n    return route(request)\n" * 400  # ~8K tokens
    load = asyncio.create_task(
        steady_traffic(
            fleet.router_url, stop, stats, concurrency=12, max_tokens=20, prompt_body=prompt
        )
    )
    source, tgts, state, outcomes = ScrapeSource(), targets(fleet), PressureState(), []
    try:
        for _ in range(ticks):
            await asyncio.sleep(1.0)
            obs = await asyncio.to_thread(source.observe, tgts, 30.0)
            views = [PodView(t.name, t.role, True, True, None, obs.signals[t.name]) for t in tgts]
            outcome = suggest_scale(views, COUNTS, BOUNDS, state)
            state = outcome.state
            outcomes.append(outcome)
    finally:
        stop.set()
        await load
    return outcomes


async def test_prefill_starvation_asks_for_one_more_prefill(fleet: tuple[str, Fleet]) -> None:
    """Regression: sustained prefill queueing with idle decode must yield prefill 1 -> 2
    (decode unchanged); a fast prefill under the same load must yield no hint at all."""
    kind, f = fleet
    outcomes = await watch(f, ticks=8)
    hints = [o.hint for o in outcomes if o.hint is not None]
    notes = [o.note for o in outcomes]
    if kind == "slow":
        assert hints, notes
        assert (hints[0].prefill, hints[0].decode) == (2, 2) and "prefill" in hints[0].reason
    else:
        assert hints == [], notes

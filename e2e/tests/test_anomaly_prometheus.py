"""The PromQL path against a REAL Prometheus (Debian package) scraping real sim workers.

Guards what canned answers cannot: that the queries `PrometheusSource` sends are valid PromQL
for this Prometheus (it once rejected our pod regex escapes with HTTP 400), that
`increase(...[window])` over the engine's real counters and the `by (namespace, pod)` grouping
land on the right pods, that a down target is reported as such, and that the planner then
singles out the faulty decode worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas_engine.sim.fleet import Fleet, free_port, router_available
from cas_operator.anomaly.detect import Policy
from cas_operator.observe import PodTarget, PrometheusSource
from e2e.runtime.prometheus import (
    PrometheusHandle,
    file_sd_scrape_config,
    prometheus_binary,
    start_prometheus,
    write_file_sd,
)
from e2e.traffic.simload import loop_under_repetition_fault

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not installed"),
    pytest.mark.timeout(150),
    pytest.mark.slow,
]
POLICY = Policy(min_checked=10, cooldown_seconds=0)
SCRAPE_S = 1.0
DOWN_PORT = free_port()


def targets(fleet: Fleet) -> list[PodTarget]:
    out = []
    for role, urls in (("prefill", fleet.prefill_urls), ("decode", fleet.decode_urls)):
        for i, url in enumerate(urls):
            host, port = url.removeprefix("http://").split(":")
            out.append(PodTarget(f"{role}-{i}", role, "ns", host, int(port)))
    out.append(PodTarget("decode-gone", "decode", "ns", "127.0.0.1", DOWN_PORT))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, PrometheusHandle]]:
    run = Path(tmp_path_factory.mktemp("prom"))
    fleet = Fleet(prefills=1, decodes=3, speedup=40.0, log_dir=run / "fleet")
    fleet.start()
    try:
        sd = run / "targets.json"
        labelled = [
            (f"{t.ip}:{t.port}", {"namespace": t.namespace, "pod": t.name, "role": t.role})
            for t in targets(fleet)
        ]
        write_file_sd(sd, labelled)
        prom = start_prometheus(run, [file_sd_scrape_config(sd, SCRAPE_S)], interval_s=SCRAPE_S)
        try:
            yield fleet, prom
        finally:
            prom.stop()
    finally:
        fleet.stop()


def wait_scraped(source: PrometheusSource, tgts: list[PodTarget], timeout: float) -> None:
    """Until Prometheus has scraped every live worker (the fault comes after, as in life)."""
    live = [t for t in tgts if t.name != "decode-gone"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obs = source.observe(live, 60)
        if all(s.error is None for s in obs.signals.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"prometheus never scraped all workers: {obs}")


async def test_promql_loop_flags_the_faulty_decode(
    stack: tuple[Fleet, PrometheusHandle],
) -> None:
    """Regression: PromQL signals from real Prometheus must single out the repetition decode,
    report the target with nothing listening as down, and keep healthy decodes clear."""
    fleet, prom = stack
    source = PrometheusSource(prom.url, timeout_seconds=5.0, stale_seconds=30.0)
    tgts = targets(fleet)
    await asyncio.to_thread(wait_scraped, source, tgts, 30.0)
    trace, stats = await loop_under_repetition_fault(
        fleet.router_url, fleet.decode_urls[1], source, tgts, POLICY, seconds=75
    )
    assert stats.failures_beyond_rare_trips() == [] and stats.ok > 0, stats.failures[:3]
    assert [name for name, _ in trace.drains] == ["decode-1"], trace.report()
    last = trace.ticks[-1]
    assert last["decode-0"][0] == "clear" and last["decode-2"][0] == "clear", trace.report()
    assert last["decode-gone"][0] == "unavailable" and "down" in last["decode-gone"][2]
    assert trace.last is not None and trace.last.signals["decode-0"].running is not None

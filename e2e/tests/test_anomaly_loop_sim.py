"""Observe -> decide against REAL engine processes: sim workers behind the real SGLang router.

No Kubernetes here (the cluster tests drive the label and pod steps): this guards the part that
unit tests cannot, namely that the metric names and label shapes the engine actually exports
are the ones the observe layer reads, and that a faulty decode worker under real traffic is the
one pod the planner wants drained, while the router's retries keep every client request good.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cas_engine.sim.fleet import Fleet, router_available
from cas_operator.anomaly.detect import Policy
from cas_operator.observe import PodTarget, ScrapeSource
from e2e.traffic.simload import loop_under_repetition_fault

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(120),
    pytest.mark.slow,
]
POLICY = Policy(min_checked=10, cooldown_seconds=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(prefills=1, decodes=3, speedup=40.0, log_dir=tmp_path_factory.mktemp("fleet"))
    f.start()
    try:
        yield f
    finally:
        f.stop()


def targets(fleet: Fleet) -> list[PodTarget]:
    """The fleet's workers as the operator would see their pods (name, role, IP, port)."""
    out = []
    for role, urls in (("prefill", fleet.prefill_urls), ("decode", fleet.decode_urls)):
        for i, url in enumerate(urls):
            host, port = url.removeprefix("http://").split(":")
            out.append(PodTarget(f"{role}-{i}", role, "ns", host, int(port)))
    return out


async def test_repetition_decode_is_the_only_pod_flagged(fleet: Fleet) -> None:
    """Regression: the observe layer must read the engine's real guard counters per pod (names,
    reason labels), and the planner must single out the faulty decode and nothing else; the
    router's retries must keep every client answer good meanwhile."""
    source, tgts = ScrapeSource(timeout_seconds=2.0), targets(fleet)
    first = source.observe(tgts, 60)
    assert first.error is None, first
    trace, stats = await loop_under_repetition_fault(
        fleet.router_url, fleet.decode_urls[1], source, tgts, POLICY, seconds=60
    )
    assert stats.failures_beyond_rare_trips() == [] and stats.ok > 0, stats.failures[:3]
    assert [name for name, _ in trace.drains] == ["decode-1"], trace.report()
    last = trace.ticks[-1]
    assert last["decode-0"][0] == "clear" and last["decode-2"][0] == "clear", trace.report()
    assert trace.last is not None and trace.last.signals["decode-1"].trips_high_accept

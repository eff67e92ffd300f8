"""Observe -> decide against REAL engine processes: sim workers behind the real SGLang router.

No Kubernetes here (the cluster tests drive the label and pod steps): this guards the part that
unit tests cannot, namely that the metric names and label shapes the engine actually exports
are the ones the observe layer reads, and that a faulty decode worker under real traffic is the
one pod the planner wants drained, while the router's retries keep every client request good.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from cas_engine.sim.fleet import Fleet, router_available
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.observe import PodTarget, ScrapeSource
from cas_operator.planning.anomaly import GuardState, PodView, Policy, decide

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(120),
    pytest.mark.slow,
]
TIMEOUT = aiohttp.ClientTimeout(total=30)
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


async def traffic(router: str, n: int, failures: list[str]) -> None:
    """`n` chat requests of 200 tokens (above the 128-token judging floor), 8 at a time."""
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def one(i: int) -> None:
            body = {
                "model": "sim",
                "messages": [{"role": "user", "content": f"refactor module {i}"}],
                "max_tokens": 200,
            }
            async with sem, s.post(f"{router}/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                if resp.status != 200 or "the same line again" in text:
                    failures.append(f"{resp.status}: {text[:200]}")

        await asyncio.gather(*[one(i) for i in range(n)])


async def set_fault(url: str, spec: dict[str, float]) -> None:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.post(f"{url}/sim/fault", json=spec) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_repetition_decode_is_the_only_pod_flagged(fleet: Fleet) -> None:
    """Regression: the observe layer must read the engine's real guard counters per pod (names,
    reason labels), and the planner must single out the faulty decode and nothing else; the
    router's retries must keep every client answer good meanwhile."""
    source = ScrapeSource(timeout_seconds=2.0)
    spec = AnomalyGuardSpec(window_seconds=60)
    tgts = targets(fleet)
    first = source.observe(tgts, spec.window_seconds)
    assert first.error is None, first
    bad_url = fleet.decode_urls[1]
    await set_fault(bad_url, {"repetition": 0.5})
    failures: list[str] = []
    state, drains, verdicts = GuardState(), [], {}
    try:
        load = asyncio.create_task(traffic(fleet.router_url, 150, failures))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (load.done() and drains):
            await asyncio.sleep(1.0)
            obs = await asyncio.to_thread(source.observe, tgts, spec.window_seconds)
            views = [
                PodView(t.name, t.role, True, t.name not in drains, None, obs.signals[t.name])
                for t in tgts
            ]  # a drained pod leaves rotation, as the act step's label removal does
            decision = decide(spec, views, state, time.monotonic(), POLICY)
            state = decision.state
            drains += [o.name for o in decision.drains]
            verdicts = decision.verdicts
        await load
    finally:
        await set_fault(bad_url, {"repetition": 0.0})
    assert failures == [], failures[:3]
    assert drains == ["decode-1"], (drains, verdicts)
    assert verdicts["decode-0"].state == "clear" and verdicts["decode-2"].state == "clear"
    assert obs.signals["decode-1"].trips_high_accept and obs.signals["decode-1"].checked
    assert verdicts["prefill-0"].state == "insufficient"  # prefill: no guard verdicts to judge

"""The routers' refusals through the REAL SGLang router (0.3.2) and a REAL Prometheus.

Guards (issue 18) that a burst refused by the router's own rate limiter reaches the operator's
metrics sources as refusals: the router counts its 429s in `smg_http_responses_total` with
`status_code="429"`, a series it creates with the first 429, and both sources must count a
series born inside the window from zero (Prometheus' `increase` starts from a series' first
sample, so the first burst, the one that matters, read as nothing), while a Prometheus that
restarted with an empty store must not count old counters as new.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cas_engine.sim.fleet import Fleet, free_port, router_available
from cas_operator.observe import PodTarget, PrometheusSource, ScrapeSource
from cas_operator.observe.types import PodSignals
from e2e.runtime.prometheus import (
    file_sd_scrape_config,
    prometheus_binary,
    start_prometheus,
    write_file_sd,
)

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not installed"),
    pytest.mark.timeout(150),
    pytest.mark.slow,
]
SCRAPE_S = 1.0
BURST = 12


def chat(url: str) -> int:
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def router_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def router_signals(prometheus_url: str, target: PodTarget) -> Callable[[], PodSignals]:
    """A reader of the router pod's signals from this Prometheus over a 60 s window."""
    source = PrometheusSource(prometheus_url, timeout_seconds=5.0, stale_seconds=30.0)
    return lambda: source.observe([target], 60).signals[target.name]


def until(
    read: Callable[[], PodSignals], check: Callable[[PodSignals], bool], timeout: float
) -> PodSignals:
    """Poll `read()` until `check(result)`; the last result either way (unlike
    `anomaly_stack.wait_for`, so that the assertion after it shows what was read)."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if check(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_a_refused_burst_is_counted_by_both_metrics_sources(tmp_path: Path) -> None:
    metrics_port = free_port()
    limits = ["--rate-limit-tokens-per-second", "1", "--max-concurrent-requests", "2",
              "--queue-size", "0", "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(metrics_port)]  # fmt: skip
    fleet = Fleet(prefills=1, decodes=1, speedup=40.0, log_dir=tmp_path / "fleet",
                  router_args=limits).start()  # fmt: skip
    try:
        target = PodTarget("router-0", "router", "ns", "127.0.0.1", metrics_port)
        sd = tmp_path / "targets.json"
        write_file_sd(sd, [(f"127.0.0.1:{metrics_port}",
                            {"namespace": "ns", "pod": "router-0", "role": "router"})])  # fmt: skip
        prom = start_prometheus(
            tmp_path, [file_sd_scrape_config(sd, SCRAPE_S)], interval_s=SCRAPE_S
        )
        try:
            from_prometheus = router_signals(prom.url, target)
            scrape = ScrapeSource()

            seen = until(from_prometheus, lambda s: s.responses is not None, 30)
            assert seen.responses is not None, seen  # Prometheus has the router's answers
            assert 'status_code="429"' not in router_metrics(metrics_port)  # no series yet
            scrape.observe([target], 60)  # the scrape source's sample before the burst

            time.sleep(3)  # the bucket refills
            with ThreadPoolExecutor(BURST) as pool:
                statuses = list(pool.map(lambda _: chat(fleet.router_url), range(BURST)))
            refused = statuses.count(429)
            assert refused >= BURST // 2 and statuses.count(200) + refused == BURST, statuses

            got = until(from_prometheus, lambda s: s.refused == refused, 20)
            assert got.refused == refused, (got, statuses)
            assert scrape.observe([target], 60).signals["router-0"].refused == refused
        finally:
            prom.stop()

        # A Prometheus that restarts with an empty store (no persistent volume) sees the old
        # counters from its first scrape: that is no new refusal. Regression: counting a series
        # without a sample a window ago from zero read the whole burst again.
        fresh = start_prometheus(
            tmp_path / "fresh", [file_sd_scrape_config(sd, SCRAPE_S)], interval_s=SCRAPE_S
        )
        try:
            from_fresh = router_signals(fresh.url, target)
            first = until(from_fresh, lambda s: s.responses is not None, 30)
            assert first.responses is not None, first  # the fresh one scrapes the router
            time.sleep(3 * SCRAPE_S)  # a few more samples of the old counters
            assert from_fresh().refused == 0.0, from_fresh()
            with ThreadPoolExecutor(BURST) as pool:  # the bucket has refilled meanwhile
                again = list(pool.map(lambda _: chat(fleet.router_url), range(BURST)))
            refused = again.count(429)
            assert refused >= BURST // 2, again
            # A series with history reads as `increase`, which extrapolates towards the window's
            # edges by up to half a scrape interval on each side of its samples.
            got = until(from_fresh, lambda s: refused <= (s.refused or 0) < refused + 1, 20)
            assert got.refused is not None and refused <= got.refused < refused + 1, (got, again)
        finally:
            fresh.stop()
    finally:
        fleet.stop()

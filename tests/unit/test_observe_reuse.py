"""The prefill engines' prompt reuse times, from their /metrics to the planner's hit-rate curve:
observe (scrape and PromQL) -> `signals.prompt_reuse` -> `quantized` -> `planner_workload` ->
`model.hit_probabilities` (issue 39, part 2).

Guards: the operator reads exactly what cas_engine exports (the exposition comes from the
engine's own tracker), sums the prefill pods only, keeps the measurement through quantizing,
and the planner uses the measured curve when there is one and Che's approximation before."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker
from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale.model import ObservedSignals, WorkloadInputs, hit_probabilities
from cas_operator.autoscale.reuse import ReuseProfile, hit_probability
from cas_operator.autoscale.signals import observed_signals, prompt_reuse, quantized
from cas_operator.desired.recommend import planner_workload
from cas_operator.observe import PodTarget, PrometheusSource, ScrapeSource
from cas_operator.observe.types import PodSignals, PodView
from tests.unit.test_observe import Clock, Server, pod, prom_answers, vector


@pytest.fixture
def http() -> Iterator[Callable[[Server], Server]]:
    """Loopback stand-ins for an engine pod's /metrics and Prometheus (test_observe's)."""
    started: list[ThreadingHTTPServer] = []

    def start(server: Server) -> Server:
        httpd = ThreadingHTTPServer((server.host, 0), server.handler())
        httpd.daemon_threads = True
        server.port = httpd.server_address[1]
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        started.append(httpd)
        return server

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


class EngineClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine() -> tuple[ReuseTracker, CollectorRegistry, EngineClock]:
    registry, clock = CollectorRegistry(), EngineClock()
    tracker = ReuseTracker(sample_rate=1, clock=clock, metrics=ReuseMetrics(registry))
    return tracker, registry, clock


def test_the_scrape_reads_what_the_engine_exports(http: Callable[[Server], Server]) -> None:
    """Two scrapes a window apart: the reuse histogram's buckets and the counters as
    windowed increases, from the exposition cas_engine's tracker really writes."""
    tracker, registry, engine_clock = _engine()
    tracker.observe(np.arange(64 * 4))  # before the window opens
    text = [generate_latest(registry).decode()]
    srv = http(Server(lambda path, q: (200, text[0].encode())))
    clock = Clock()
    source = ScrapeSource(clock=clock)
    target = [PodTarget("p0", "prefill", "ns", "127.0.0.1", srv.port)]
    assert source.observe(target, 60).signals["p0"].reuse_buckets is None  # one scrape
    engine_clock.now = 40.0
    tracker.observe(np.arange(64 * 6 + 5))  # 4 blocks back after 40 s, 2 new
    clock.t, text[0] = 1060.0, generate_latest(registry).decode()
    s = source.observe(target, 60).signals["p0"]
    assert s.reuse_buckets is not None
    buckets = dict(s.reuse_buckets)
    assert buckets[30.0] == 0.0 and buckets[45.0] == 4 * 64 and buckets[math.inf] == 4 * 64
    assert s.first_seen_tokens == 2 * 64 and s.reuse_requests == 1
    assert s.reuse_request_tokens == 6 * 64 and s.reuse_request_token_squares == (6 * 64) ** 2
    assert s.returning_prompt_tokens == 6 * 64 + 5


def test_promql_asks_for_the_reuse_buckets_and_counters_per_pod(
    http: Callable[[Server], Server],
) -> None:
    answers = prom_answers({"d0": 1.0, "d1": 1.0, "p0": 1.0}, {"d0": 1.0, "d1": 1.0, "p0": 1.0})
    counters = {
        "cas_prefix_first_seen_tokens_total": 640.0,
        "cas_prefix_requests_total": 3.0,
        "cas_prefix_request_tokens_total": 1920.0,
        "cas_prefix_request_token_squares_total": 1.3e6,
        "cas_prefix_returning_prompt_tokens_total": 1300.0,
    }

    def respond(path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        q = query["query"][0]
        if "cas_prefix_reuse_seconds_bucket" in q:
            rows = [(pod("p0", le=le), v) for le, v in (("10.0", 512.0), ("+Inf", 1280.0))]
            return 200, vector(rows)
        for name, value in counters.items():
            if name in q:
                return 200, vector([(pod("p0"), value)])
        return answers(path, query)

    srv = http(Server(respond))
    targets = [PodTarget("d0", "decode", "ns"), PodTarget("p0", "prefill", "ns")]
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(targets, 60)
    p0 = obs.signals["p0"]
    assert p0.reuse_buckets == ((10.0, 512.0), (math.inf, 1280.0))
    assert (p0.first_seen_tokens, p0.reuse_requests, p0.returning_prompt_tokens) == (
        640.0,
        3.0,
        1300.0,
    )
    assert obs.signals["d0"].reuse_buckets is None and obs.signals["d0"].reuse_requests is None
    (q,) = [q for q in srv.seen if "cas_prefix_reuse_seconds_bucket" in q]
    assert "le)" in q and "[60s]" in q and "increase(" in q


def _prefill(buckets: tuple[tuple[float, float], ...], first: float, requests: float) -> PodSignals:
    return PodSignals(
        reuse_buckets=buckets,
        first_seen_tokens=first,
        reuse_requests=requests,
        reuse_request_tokens=1000.0 * requests,
        reuse_request_token_squares=1000.0**2 * requests,
        returning_prompt_tokens=900.0 * requests,
    )


def test_the_fleet_profile_sums_the_prefill_pods_only() -> None:
    a = _prefill(((10.0, 300.0), (math.inf, 600.0)), first=400.0, requests=1.0)
    b = _prefill(((10.0, 700.0), (math.inf, 1000.0)), first=0.0, requests=1.0)
    decode = _prefill(((10.0, 9e9), (math.inf, 9e9)), first=0.0, requests=5.0)
    views = [
        PodView("p0", "prefill", True, True, signals=a),
        PodView("p1", "prefill", True, True, signals=b),
        PodView("d0", "decode", True, True, signals=decode),
    ]
    profile = observed_signals(views, 60.0).reuse
    assert profile is not None
    assert profile.reused == ((10.0, 0.5), (math.inf, 0.8))  # (300+700)/2000, 1600/2000
    assert profile.tokens_per_request == 1000.0 and profile.size_biased_tokens == 1000.0
    assert profile.returning_share == pytest.approx(1800.0 / 2000.0)
    assert prompt_reuse([PodSignals(), PodSignals(reuse_buckets=((math.inf, 0.0),))]) is None


def test_quantizing_keeps_the_profile_in_coarse_steps() -> None:
    """Shares in 0.005 steps and sizes to 3 and 2 digits; the returning share to 0.001, as the
    planner reads the first turns' token share from its distance to 1 (`reuse.request_mix`:
    real sessions' first turns are 1-2% of the tokens, which steps of 0.01 would halve or
    double)."""
    profile = ReuseProfile(
        ((10.0, 0.4012), (60.0, 0.39999), (math.inf, 0.91234)), 123_456.0, 208_765.0, 0.97123
    )
    q = quantized(ObservedSignals(reuse=profile)).reuse
    assert q == ReuseProfile(
        ((10.0, 0.4), (60.0, 0.4), (math.inf, 0.91)), 123_000.0, 210_000.0, 0.971
    )
    assert quantized(ObservedSignals()).reuse is None


def _trace_like(pause_s: float) -> ReuseProfile:
    bounds = tuple(2.0**k for k in range(-2, 17))
    mu, sigma = math.log(pause_s), 2.0
    reused = tuple(
        (b, 0.95 * 0.5 * math.erfc(-(math.log(b) - mu) / (sigma * math.sqrt(2.0)))) for b in bounds
    )
    return ReuseProfile((*reused, (math.inf, 0.95)), 100_000.0, 180_000.0, 1.0)


def test_the_planner_uses_the_measured_curve_and_falls_back_without_one() -> None:
    """With a measurement the hit probability is the reuse model's and moves with the reuse
    times at the same rate, cache and cycle; without one it is Che's approximation."""
    declared = WorkloadSpec(request_rate=2.0, avg_input_tokens=100_000, avg_output_tokens=400)
    slow, fast = _trace_like(60.0), _trace_like(10.0)
    wl = planner_workload(declared, 2.0, ObservedSignals(reuse=slow))
    assert wl.reuse is slow
    gpu, _ = hit_probabilities(wl, 4e6, 0.0, 30.0)
    assert gpu == pytest.approx(hit_probability(slow, 4e6, 2.0))
    faster, _ = hit_probabilities(replace(wl, reuse=fast), 4e6, 0.0, 30.0)
    assert faster > gpu + 0.05
    che = planner_workload(declared, 2.0, None)
    assert che.reuse is None
    assert hit_probabilities(che, 4e6, 0.0, 30.0) == hit_probabilities(
        replace(che, reuse=None), 4e6, 0.0, 30.0
    )
    assert hit_probabilities(che, 4e6, 0.0, 30.0)[0] != pytest.approx(gpu, abs=0.01)


def test_the_host_tier_never_hits_less_than_the_gpu_alone() -> None:
    wl = WorkloadInputs(2.0, 100_000.0, 400.0, reuse=_trace_like(30.0))
    gpu, both = hit_probabilities(wl, 2e6, 6e6, 30.0)
    assert 0.0 < gpu < both <= 1.0

"""Fleet simulator: vectorised queue pieces against hand-computed cases, and small end-to-end
runs whose outcome direction is known (more prefill lowers TTFT, KV pressure causes waits, a
narrow NIC stretches TTFT, scale commands honour pod start and drain)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.fleetsim import (
    FleetConfig,
    Modifier,
    SessionMix,
    SessionWorkload,
    SimResult,
    parse_trace,
    simulate,
)
from bench.fleetsim.engine import (
    FleetView,
    Limit,
    Metrics,
    Simulator,
    _Pool,
    kv_bounded_prefill,
    spread,
)
from bench.fleetsim.policies import (
    FixedPolicy,
    MeanBasedPolicy,
    RatioPlannerPolicy,
    SwitchPolicy,
)
from bench.fleetsim.workload import synth_trace_lines
from cas_operator.autoscale import profiles as pf
from cas_operator.autoscale.model import Bounds, SloInputs, closed_throughput
from cas_operator.autoscale.search import recommend

SPEC = pf.load_spec("glm5-fp8-h200")
P = pf.prefill_profile(SPEC)
D = pf.decode_profile(SPEC)
# ~3 req/s of short sessions: these tests check the simulator's mechanics on a small fleet, so
# they keep a mix of their own (SessionMix's defaults are the real sessions', far longer)
MIX = SessionMix(
    session_rate=0.15,
    mean_turns=20.0,
    first_input_tokens=32_000.0,
    first_input_sigma=0.5,
    new_tokens_per_turn=3_400.0,
    new_tokens_sigma=1.0,
    output_tokens=400.0,
    output_sigma=0.8,
    tool_pause_s=20.0,
    tool_pause_sigma=1.0,
    max_context=180_000.0,
)


def _cfg(n_p: int, n_d: int, **kw: object) -> FleetConfig:
    base: dict[str, object] = dict(
        prefill=P,
        decode=D,
        n_prefill=n_p,
        n_decode=n_d,
        max_prefill=16,
        max_decode=16,
        duration_s=300.0,
        warmup_s=100.0,
        seed=3,
    )
    base.update(kw)
    return FleetConfig(**base)  # type: ignore[arg-type]


WL = SessionWorkload(MIX, seed=1)


@pytest.fixture(scope="module")
def baseline() -> SimResult:
    """5 prefill + 2 decode instances at ~3 req/s: the reference run several tests compare to."""
    return simulate(_cfg(5, 2), WL)


def _pool(n: int) -> _Pool:
    return _Pool(n, n)


def test_prefill_without_a_kv_bound_is_fifo_per_instance() -> None:
    """Guards the prefill recursion with room for everything: two instances, out-of-order
    input, a busy GPU; each instance is a FIFO server and sends after computing."""
    inst = np.array([1, 0, 1, 0, 1])
    arr = np.array([0.5, 0.0, 0.2, 3.0, 0.3])
    svc = np.array([1.0, 2.0, 1.0, 1.0, 0.5])
    pool = _pool(2)
    pool.busy[:] = [0.0, 1.0]
    zero = np.zeros(5)
    times = kv_bounded_prefill(inst, arr, zero, svc, zero, np.ones(5), 1e9, pool)
    # instance 0: 0.0 (2s) -> 2.0, 3.0 -> 4.0; instance 1 busy until 1.0: 0.2 -> 2.0,
    # 0.3 -> 2.5, 0.5 -> 3.5
    assert times.computed.tolist() == pytest.approx([3.5, 2.0, 2.0, 4.0, 2.5])
    assert times.sent.tolist() == pytest.approx(times.computed.tolist())
    assert pool.busy.tolist() == pytest.approx([4.0, 3.5])


def test_prefill_admits_only_what_fits_and_releases_when_sent() -> None:
    """Guards the LayerSplit mechanism in the simulator: with room for two contexts, the third
    request waits until the first one's KV has been sent, although the GPU is free sooner."""
    inst = np.zeros(3, dtype=np.int64)
    arr = np.zeros(3)
    load = np.full(3, 0.5)  # host-tier prefix: GPU free for others meanwhile
    busy = np.ones(3)
    send = np.full(3, 2.0)
    pool = _pool(1)
    times = kv_bounded_prefill(inst, arr, load, busy, send, np.full(3, 100.0), 200.0, pool)
    # r0: load to 0.5, GPU 0.5-1.5, send 1.5-3.5; r1: load to 0.5, GPU 1.5-2.5, send 3.5-5.5;
    # r2 is admitted at 3.5 (r0 sent), loads to 4.0, GPU 4.0-5.0, sends 5.5-7.5.
    assert times.computed.tolist() == pytest.approx([1.5, 2.5, 5.0])
    assert times.sent.tolist() == pytest.approx([3.5, 5.5, 7.5])
    roomy = kv_bounded_prefill(inst, arr, load, busy, send, np.full(3, 100.0), 300.0, _pool(1))
    assert roomy.computed.tolist() == pytest.approx([1.5, 2.5, 3.5])


def test_simulated_prefill_throughput_matches_the_closed_network_bound() -> None:
    """Guards model/simulator agreement on the KV bound: a saturated instance sustains what
    ``closed_throughput`` predicts for its concurrency, within the gap between exponential
    (model) and fixed (simulated) service times."""
    n = 4000
    for slots in (1, 2, 4):
        pool = _pool(1)
        times = kv_bounded_prefill(
            np.zeros(n, dtype=np.int64),
            np.linspace(0.0, 100.0, n),  # far beyond capacity
            np.full(n, 0.3),
            np.ones(n),
            np.full(n, 0.4),
            np.full(n, 10.0),
            10.0 * slots,
            pool,
        )
        sim = (n - 1000) / (times.sent[-1] - times.sent[999])
        model = closed_throughput(1.0, 0.7, slots)
        assert sim == pytest.approx(min(slots / 1.7, 1.0), rel=0.01)
        assert model <= sim + 1e-9 and sim / model < 1.2


def test_spread_prefers_least_loaded_eligible() -> None:
    """Guards routing of misses: least loaded first, ineligible servers never chosen."""
    load = np.array([5.0, 1.0, 0.0, 3.0])
    ok = np.array([True, True, False, True])
    assert spread(4, load, ok).tolist() == [1, 3, 0, 1]
    assert spread(2, load, np.zeros(4, dtype=bool)).tolist() == [-1, -1]


def test_trace_parsing_reuses_common_block_prefix() -> None:
    """Guards JSONL replay: a request sharing its first two blocks with the previous request of
    the same conversation has 2 x 512 cached tokens; millisecond timestamps become seconds."""
    lines = [
        '{"timestamp": 5000, "input_length": 1500, "output_length": 10, "hash_ids": [7, 8, 9]}',
        '{"timestamp": 7000, "input_length": 2000, "output_length": 5, "hash_ids": [7, 8, 10, 11]}',
        '{"timestamp": 6000, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}',
    ]
    tr = parse_trace(lines)
    assert tr.arrival.tolist() == [0.0, 1.0, 2.0]
    assert tr.cached_prefix.tolist() == [0.0, 0.0, 1024.0]
    assert tr.conversation[0] == tr.conversation[2] != tr.conversation[1]


def test_more_prefill_lowers_ttft_and_caches_hit(baseline: SimResult) -> None:
    """Guards the prefill queue and prefix routing: at the same load, more prefill instances
    give a lower TTFT p90, and returning turns hit the prefix cache (~90% of tokens)."""
    few = simulate(_cfg(2, 2), WL).goodput(3.0, 50.0)
    many = baseline.goodput(3.0, 50.0)
    assert many["ttft_p90_s"] < few["ttft_p90_s"]
    assert 0.8 < many["hit_rate"] < 0.98
    assert many["requests"] > 500


def test_decode_kv_pressure_makes_requests_wait(baseline: SimResult) -> None:
    """Guards KV admission: a decode instance with little KV makes requests wait (TTFT grows)
    or retract, while ITL alone looks fine."""
    tight_d = replace(D, kv_capacity_tokens=D.kv_capacity_tokens * 0.12)
    tight = simulate(_cfg(5, 2, decode=tight_d), WL)
    g_roomy, g_tight = baseline.goodput(3.0, 50.0), tight.goodput(3.0, 50.0)
    assert g_tight["ttft_p90_s"] > g_roomy["ttft_p90_s"] + 1.0
    assert g_tight["itl_p50_ms"] < 50.0


def test_narrow_nic_stretches_ttft(baseline: SimResult) -> None:
    """Guards the KV transfer link: 1% of the NIC bandwidth makes whole-context transfers
    queue on the prefill side's link."""
    narrow_p = replace(
        P, nic_bytes_per_s=P.nic_bytes_per_s * 0.01, flow_bytes_per_s=P.flow_bytes_per_s * 0.01
    )
    base = baseline.goodput(3.0, 50.0)
    slow = simulate(_cfg(5, 2, prefill=narrow_p), WL).goodput(3.0, 50.0)
    assert slow["ttft_p90_s"] > base["ttft_p90_s"] + 0.5


def test_scale_up_counts_gpus_before_pods_serve() -> None:
    """Guards pod start: a scale-up holds GPUs at once (Pending counts) but adds capacity only
    after pod_start_s; the series shows the new spec immediately."""
    p_slow = replace(P, pod_start_s=300.0)
    wl = SessionWorkload(MIX, seed=5)
    res = simulate(_cfg(3, 2, prefill=p_slow, tick_s=30.0), wl, policy=FixedPolicy(8, 2))
    assert res.peak_gpus == (8 + 2) * 8
    assert res.scale_actions == 1
    assert res.series[0]["prefill"] == 8
    avg = res.gpu_seconds / 300.0
    assert avg > 70  # GPUs held from the first tick; the new pods serve only after 300 s


def test_storm_and_output_shift_modifiers() -> None:
    """Guards workload modifiers: a session-start storm raises the arrival rate inside its
    window; an output shift multiplies output lengths after its start."""
    wl = SessionWorkload(
        MIX,
        (Modifier("session_rate", 4.0, 100.0, 200.0), Modifier("output_tokens", 3.0, 300.0)),
        seed=6,
    )
    assert wl.value("session_rate", 150.0) == pytest.approx(4 * MIX.session_rate)
    assert wl.value("session_rate", 250.0) == pytest.approx(MIX.session_rate)
    res = simulate(_cfg(5, 3, duration_s=400.0, warmup_s=0.0), wl)
    early = res.output_tokens[res.arrival < 250.0].mean()
    late = res.output_tokens[res.arrival > 350.0].mean()
    assert late > 2.0 * early


def test_trace_replay_runs_open_loop() -> None:
    """Guards trace replay end to end: every trace request completes and repeated prefixes
    are served from cache."""
    tr = parse_trace(synth_trace_lines(400, rate=2.0, seed=7))
    res = simulate(_cfg(2, 1, duration_s=260.0, warmup_s=0.0), trace=tr)
    assert res.arrival.size >= 380
    assert res.cached_tokens.sum() > 0.5 * res.input_tokens.sum()


def test_mean_based_baseline_ignores_kv_tails() -> None:
    """Guards the baseline's published equations: decode throughput at the ITL target on the
    mean context only, prefill throughput at a fixed hit rate."""
    mb = MeanBasedPolicy(P, D, SloInputs(3.0, 50.0), Bounds())
    assert mb.prefill_thpt(64_000) == pytest.approx(
        64_000 / P.prefill_time(64_000 * 0.1, 64_000 * 0.9)
    )
    assert mb.decode_thpt(64_000) > 0


def _metrics(**kw: float) -> Metrics:
    base: dict[str, float] = dict(
        arrival_rate=20.0,
        hit_rate=0.93,
        ttft_p90_s=2.0,
        itl_ms=15.0,
        avg_input_tokens=75_000.0,
        p95_input_tokens=150_000.0,
        avg_output_tokens=400.0,
        first_turn_fraction=0.05,
        tool_pause_s=20.0,
        prefill_backlog_s=0.5,
        decode_kv_usage=0.5,
        decode_waiting=0,
    )
    base.update(kw)
    return Metrics(**base)  # type: ignore[arg-type]


def test_planner_policy_does_not_read_closed_loop_throttling_as_lower_demand() -> None:
    """Regression (simulator: output-length shift): once decode was overloaded, sessions waited
    for answers, so the measured rate fell and first turns took a larger share; the slow loop
    planned for that throttled load and kept decode short. Under overload (TTFT p90 over 2x the
    SLO) it now plans for the last healthy rate and first-turn share, with the new lengths."""
    slo = SloInputs(ttft_s=3.0, itl_ms=50.0)
    bounds = Bounds(max_prefill=31, max_decode=31, gpu_budget=256)
    policy = RatioPlannerPolicy(P, D, slo, bounds)
    view = FleetView(24, 8, 24, 8)
    policy._slow(0.0, _metrics(), view)
    hot = _metrics(
        arrival_rate=8.0,
        ttft_p90_s=30.0,
        avg_output_tokens=1600.0,
        first_turn_fraction=0.15,
        decode_kv_usage=0.98,
        decode_waiting=500,
    )
    policy._slow(0.0, hot, view)
    assert policy.last_rec is not None
    held = replace(policy._workload(hot, 20.0 * policy.headroom), first_turn_fraction=0.05)
    seen = policy._with_ttft(None, hot, view)  # the TTFT the planner reads, and nothing else
    assert seen is not None and seen.decode_kv_usage is None
    want = recommend(held, slo, P, D, bounds, observed=seen)
    assert (policy.last_rec.n_prefill, policy.last_rec.n_decode) == (want.n_prefill, want.n_decode)
    assert "of 22.0 req/s" in policy.last_rec.reason  # the held demand, not the 8 let in


def test_decode_waiting_counts_only_requests_whose_kv_has_arrived() -> None:
    """Regression: the metric counted every request between prefill admission and decode
    admission, so requests still being prefilled read as 'waiting for decode KV' (~20 at the
    benchmark's load on an idle decode pool) and the planner's KV recalibration added decode
    instances that were not needed. With ample decode nothing waits, while requests are in
    prefill at some ticks."""
    seen: list[tuple[int, int]] = []
    sim: Simulator | None = None

    def probe(now: float, m: Metrics, fleet: FleetView) -> tuple[int, int]:
        assert sim is not None
        seen.append((m.decode_waiting, len(sim.wait)))
        return fleet.prefill, fleet.decode

    sim = Simulator(_cfg(5, 4), workload=WL, policy=probe)
    sim.run()
    assert seen and all(waiting == 0 for waiting, _ in seen)
    assert any(in_flight > 0 for _, in_flight in seen)


def test_new_tokens_per_turn_modifier_applies_at_turn_time() -> None:
    """Guards the reading -> writing shift of the budget-capped-rebalance scenario: the tool
    result a session adds between turns is read through the workload's modifiers when the turn
    finishes (it was the mix's constant, so a ``new_tokens_per_turn`` modifier did nothing).
    With a x0.1 modifier from 150 s, returning turns that hit their cache prefill about the
    new tokens plus the last output (~3,800 -> ~740), and earlier turns are unchanged."""
    shift = SessionWorkload(MIX, (Modifier("new_tokens_per_turn", 0.1, 150.0),), seed=1)
    plain = simulate(_cfg(5, 3, duration_s=400.0, warmup_s=0.0), WL)
    shifted = simulate(_cfg(5, 3, duration_s=400.0, warmup_s=0.0), shift)

    def uncached(res: SimResult, lo: float, hi: float) -> float:
        hit = (res.cached_tokens > 5_000) & (res.arrival >= lo) & (res.arrival < hi)
        return float(np.median((res.input_tokens - res.cached_tokens)[hit]))

    assert uncached(shifted, 250.0, 400.0) < 0.5 * uncached(plain, 250.0, 400.0)
    assert uncached(shifted, 0.0, 150.0) == pytest.approx(uncached(plain, 0.0, 150.0), rel=0.25)


def test_planner_policy_replans_early_when_a_side_fails() -> None:
    """Regression (simulator: budget-capped rebalance): after a reading -> writing shift the
    decode KV filled within a minute, but the slow loop kept its pre-shift target until its
    next 5-minute run. While a side is failing the policy re-plans after ``replan_s``; on a
    healthy fleet it keeps the slow period."""
    slo = SloInputs(ttft_s=3.0, itl_ms=50.0)
    bounds = Bounds(max_prefill=27, max_decode=27, gpu_budget=224)
    view = FleetView(21, 7, 21, 7)
    for metrics, replans in (
        (_metrics(decode_kv_usage=0.98, decode_waiting=50), 2),
        (_metrics(), 1),
    ):
        policy = RatioPlannerPolicy(P, D, slo, bounds, start_s=0.0)
        policy(0.0, _metrics(), view)
        policy(policy.replan_s + 30.0, metrics, view)
        assert policy.recommendations == replans


def test_prefill_pressure_does_not_rush_a_cut_of_decode_at_the_cap() -> None:
    """Regression (simulator: session storm): during the storm the slow loop's over-capacity
    plan was 27P:5D and prefill was failing; a rebalance taken at once cut decode 8 -> 6, which
    then collapsed (KV full, requests waiting) and stayed collapsed (quick run: 23.3 -> 8.9
    req/s). Capacity is rushed only to a failing decode: with prefill failing, decode keeps
    its pods for ``rebalance_stable_s`` as before."""
    slo = SloInputs(ttft_s=3.0, itl_ms=50.0)
    bounds = Bounds(max_prefill=31, max_decode=31, gpu_budget=256)
    policy = RatioPlannerPolicy(P, D, slo, bounds, start_s=0.0)
    policy.target, policy.last_slow = (27, 5), 0.0
    hot = _metrics(ttft_p90_s=4.5, prefill_backlog_s=4.4, decode_kv_usage=0.5)
    view = FleetView(24, 8, 24, 8)
    for now in np.arange(30.0, 290.0, 30.0):
        policy.last_slow = now  # keep the slow target fixed: this guards the control step
        assert policy(float(now), hot, view)[1] == 8


def test_planner_policy_rushes_capacity_to_decode_only_when_decode_is_saturated() -> None:
    """Guards the urgent rebalance's trigger. Budget-capped rebalance: decode KV full with
    requests waiting and a healthy prefill -> the prefill step of 21P:7D -> 15P:13D is taken
    on the first tick, but only when the plan itself asks for more decode (the fast loop's
    one-instance nudge for a queue at the right split keeps the wait). Long tool pauses
    (regression: 96% -> 92% of exhaustive): in the cold
    start TTFT was over with one request waiting for decode at 85% KV, which also reads as
    'decode failing'; rushing a 25P:7D -> 23P:9D move on that cost the run 1 req/s, so there
    the lower prefill target still waits ``rebalance_stable_s``."""
    slo = SloInputs(ttft_s=3.0, itl_ms=50.0)

    def first_prefill(target: tuple[int, int], fleet: tuple[int, int], m: Metrics) -> int:
        n = sum(fleet)
        bounds = Bounds(max_prefill=n - 1, max_decode=n - 1, gpu_budget=8 * n)
        policy = RatioPlannerPolicy(P, D, slo, bounds, start_s=0.0)
        policy.target, policy.last_slow = target, 30.0
        return policy(30.0, m, FleetView(*fleet, *fleet))[0]

    saturated = _metrics(ttft_p90_s=12.9, decode_kv_usage=0.99, decode_waiting=174)
    assert first_prefill((15, 13), (21, 7), saturated) == 15
    # the plan itself asks for no more decode (a queue at the right split): no rush
    assert first_prefill((14, 14), (13, 15), saturated) == 13
    assert first_prefill((13, 13), (15, 13), saturated) == 15
    cold = _metrics(ttft_p90_s=23.6, prefill_backlog_s=1.2, decode_kv_usage=0.85, decode_waiting=1)
    assert first_prefill((23, 9), (25, 7), cold) == 25


def test_admission_admits_at_the_rate_and_sends_the_rest_back() -> None:
    """Guards the simulator's model of `router.admission` (issue 18): arrivals beyond the
    token bucket's rate are refused (counted in ``shed``) and their sessions send the turn
    again; what enters the pools is the rate plus one burst, for the ready pools the
    admission callback was asked about."""
    asked: list[tuple[int, int]] = []

    def one_per_second(n_p: int, n_d: int) -> Limit:
        asked.append((n_p, n_d))
        return Limit(1.0)

    res = simulate(_cfg(5, 2, warmup_s=0.0, admission=one_per_second), WL)
    free = simulate(_cfg(5, 2, warmup_s=0.0), WL)
    assert free.shed == 0
    assert free.arrival.size > 2.0 * 300.0  # ~3 req/s offered
    assert res.shed > 0
    assert res.arrival.size <= 1.0 * 300.0 + 5.0 + 1.0  # rate x time + ADMISSION_BURST_S
    assert res.arrival.size >= 0.8 * 300.0
    assert (5, 2) in asked


def test_an_in_flight_bound_refuses_while_that_many_requests_are_held() -> None:
    """Guards the simulator's model of smg's admission (`router.implementation: smg`): its
    `--max-concurrent-requests` bounds the requests in flight as well as sizing the bucket, so
    with a generous rate and a bound of 2 the pools never hold more than 2 (prefill and decode
    together), and the rest is refused and sent again."""
    held: list[int] = []

    class Watched(Simulator):
        def _admit_decode(self, t0: float, t1: float) -> None:
            held.append(len(self.wait) + len(self.act))
            super()._admit_decode(t0, t1)

    bounded = Watched(_cfg(5, 2, warmup_s=0.0, admission=lambda _p, _d: Limit(50.0, 2.0)),
                      workload=WL).run()  # fmt: skip
    rate_only = simulate(_cfg(5, 2, warmup_s=0.0, admission=lambda _p, _d: Limit(50.0)), WL)
    assert max(held) <= 2 and bounded.shed > 0
    assert rate_only.shed == 0  # the rate alone would have admitted every arrival
    assert bounded.arrival.size < rate_only.arrival.size


def test_the_clairvoyant_switch_moves_at_the_shift_within_the_budget() -> None:
    """Guards the benchmark's online-bound reference (issue 18): the pre-shift split until the
    shift; from it, the shrinking pool at once and the growing one only into GPUs whose pods
    have gone (at 32 instances, 26P:6D -> 16P:16D: decode waits for the prefill drain)."""
    switch = SwitchPolicy((26, 6), (16, 16), 900.0, 32, P, D)
    m = _metrics()
    assert switch(899.0, m, FleetView(26, 6, 26, 6)) == (26, 6)
    assert switch(900.0, m, FleetView(26, 6, 26, 6)) == (16, 6)  # prefill pods still draining
    assert switch(930.0, m, FleetView(16, 6, 20, 6)) == (16, 12)  # grows into what has gone
    assert switch(960.0, m, FleetView(16, 12, 16, 12)) == (16, 16)

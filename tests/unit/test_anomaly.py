"""Anomaly decisions over recorded metric series (pure planner, no cluster, no clock).

A "recording" is cumulative guard counters per pod sampled every 5 s, as a Prometheus scrape
would see them; each tick feeds the window's increase (like `increase(...[300s])`) to `decide`.
Series come from a seeded generator so every run replays the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from cas_operator.anomaly.detect import (
    REASON_HIGH_ACCEPT,
    REASON_LOW_ACCEPT,
    REASON_QUARANTINE,
    GuardState,
    Policy,
    decide,
    drain_capacity,
    judge_pod,
)
from cas_operator.api.models import AnomalyGuardSpec, GuardAction
from cas_operator.observe.types import PodSignals, PodView
from cas_operator.stats import poisson_sf

TICK = 5.0
WINDOW = 300.0
HEALTHY_RATE = 3e-4  # 3 bad outputs per 10,000: the production report's post-fix level


@dataclass
class Pod:
    """One recorded pod: per-tick requests checked and trip rates of each tail."""

    name: str
    role: str = "decode"
    low_rate: float = HEALTHY_RATE / 2
    high_rate: float = HEALTHY_RATE / 2
    fault_from: int | None = None  # tick the fault starts
    fault_low: float = 0.0
    fault_high: float = 0.0
    serving: bool = True
    draining_since: float | None = None
    missing_from: int | None = None
    cum: list[tuple[float, float, float]] = field(default_factory=list)


def record(pods: list[Pod], ticks: int, seed: int, per_tick: float = 20.0) -> None:
    """Fill each pod's cumulative (checked, low, high) counters for `ticks` scrapes."""
    rng = np.random.default_rng(seed)
    for pod in pods:
        checked = low = high = 0.0
        pod.cum = []
        for t in range(ticks):
            n = float(rng.poisson(per_tick)) if pod.role == "decode" else 0.0
            lo, hi = pod.low_rate, pod.high_rate
            if pod.fault_from is not None and t >= pod.fault_from:
                lo, hi = lo + pod.fault_low, hi + pod.fault_high
            checked += n
            low += float(rng.binomial(int(n), min(lo, 1.0)))
            high += float(rng.binomial(int(n), min(hi, 1.0)))
            pod.cum.append((checked, low, high))


def window_signals(pod: Pod, t: int) -> PodSignals:
    """The window's increase at tick t (what `increase(x[300s])` returns)."""
    if pod.missing_from is not None and t >= pod.missing_from:
        return PodSignals(error="scrape timed out")
    back = max(0, t - int(WINDOW / TICK))
    c1, l1, h1 = pod.cum[t]
    c0, l0, h0 = pod.cum[back] if t - int(WINDOW / TICK) >= 0 else (0.0, 0.0, 0.0)
    return PodSignals(
        checked=c1 - c0,
        trips_low_accept=l1 - l0,
        trips_high_accept=h1 - h0,
        unhealthy_by_quarantine=False,
    )


def views(pods: list[Pod], t: int) -> list[PodView]:
    return [
        PodView(
            name=p.name,
            role=p.role,
            ready=True,
            serving=p.serving,
            draining_since=p.draining_since,
            signals=window_signals(p, t),
        )
        for p in pods
    ]


@dataclass
class Replay:
    """What a replay of a recording did: drain ticks per pod, Degraded ticks, events."""

    drained: dict[str, int] = field(default_factory=dict)
    degraded_ticks: list[int] = field(default_factory=list)
    unavailable_ticks: list[int] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def replay(
    pods: list[Pod],
    ticks: int,
    spec: AnomalyGuardSpec,
    start: int = 0,
    policy: Policy | None = None,
) -> Replay:
    """Feed ticks to `decide`, applying its drains to the recorded pods as the act step would."""
    state, out = GuardState(), Replay()
    for t in range(start, ticks):
        now = t * TICK
        decision = decide(spec, views(pods, t), state, now, policy)
        state = decision.state
        out.events += decision.events
        if decision.degraded:
            out.degraded_ticks.append(t)
        if decision.unavailable:
            out.unavailable_ticks.append(t)
        for order in decision.drains:
            out.drained[order.name] = t
            pod = next(p for p in pods if p.name == order.name)
            pod.serving, pod.draining_since = False, now
    return out


def fleet(n_decode: int = 8, n_prefill: int = 2) -> list[Pod]:
    return [Pod(f"decode-{i}") for i in range(n_decode)] + [
        Pod(f"prefill-{i}", role="prefill") for i in range(n_prefill)
    ]


SPEC = AnomalyGuardSpec()  # threshold 0.001, window 300 s, Replace, 25 %


def test_poisson_tail_matches_known_values() -> None:
    """Regression: the significance test must not underflow for large means (exp(-lam) = 0)."""
    assert poisson_sf(1, 0.2) == pytest.approx(1 - np.exp(-0.2))
    assert poisson_sf(3, 0.1) == pytest.approx(1.5465e-4, rel=1e-3)
    assert poisson_sf(1000, 500) < 1e-50
    assert poisson_sf(400, 500) > 0.99
    assert poisson_sf(0, 3.0) == 1.0


def test_corrupted_pod_among_healthy_is_drained_alone() -> None:
    """Regression: one pod with collapsed accept length must be drained, and no healthy one."""
    pods = fleet()
    pods[3].fault_from, pods[3].fault_low = 70, 0.02
    record(pods, 160, seed=1)
    out = replay(pods, 160, SPEC, start=60)
    assert list(out.drained) == ["decode-3"]
    onset_to_drain = (out.drained["decode-3"] - 70) * TICK
    assert onset_to_drain <= 120.0
    assert any(e[1] == "DrainingPod" and REASON_LOW_ACCEPT in e[2] for e in out.events)
    assert out.degraded_ticks == []


def test_repetition_pod_is_drained_on_the_high_tail() -> None:
    """Regression: the high-accept-rate (repetition) tail must count as well as the low one."""
    pods = fleet()
    pods[5].fault_from, pods[5].fault_high = 70, 0.03
    record(pods, 160, seed=2)
    out = replay(pods, 160, SPEC, start=60)
    assert list(out.drained) == ["decode-5"]
    assert any(REASON_HIGH_ACCEPT in e[2] for e in out.events if e[1] == "DrainingPod")


def test_fleet_wide_incident_degrades_and_drains_nothing() -> None:
    """Regression: when most pods go bad together (shared cause), draining them all would take
    the fleet down; the planner must report Degraded and drain nothing."""
    pods = fleet()
    for pod in pods[:6]:
        pod.fault_from, pod.fault_low = 70, 0.02
    record(pods, 160, seed=3)
    out = replay(pods, 160, SPEC, start=60)
    assert out.drained == {}
    assert out.degraded_ticks, "a fleet-wide rise must set Degraded"
    assert any(e[1] == "FleetWideAnomaly" for e in out.events)


def test_noisy_healthy_fleet_never_drains() -> None:
    """Regression: healthy pods at 3-8 bad outputs per 10,000 with random bursts are noise;
    an hour of ticks over 16 pods must produce zero drains (false drains per hour = 0)."""
    pods = [Pod(f"decode-{i}", low_rate=4e-4, high_rate=4e-4) for i in range(16)]
    ticks = int(3600 / TICK) + 60
    record(pods, ticks, seed=4, per_tick=40.0)
    out = replay(pods, ticks, SPEC, start=60)
    assert out.drained == {}
    assert out.degraded_ticks == []


def test_missing_data_means_no_action_and_a_reason() -> None:
    """Regression: a pod whose scrape fails must not be drained on stale numbers, and a
    fleet-wide outage must be reported as "signal unavailable" rather than as healthy."""
    pods = fleet(4, 1)
    pods[1].fault_from, pods[1].fault_low, pods[1].missing_from = 61, 0.05, 61
    record(pods, 120, seed=5)
    out = replay(pods, 120, SPEC, start=60)
    assert out.drained == {}
    verdict = decide(SPEC, views(pods, 100), GuardState(), 500.0).verdicts["decode-1"]
    assert verdict.state == "unavailable" and "timed out" in verdict.reason

    for pod in pods:
        pod.missing_from = 0
    decision = decide(SPEC, views(pods, 100), GuardState(), 500.0)
    assert decision.unavailable is not None and "unavailable" in decision.unavailable
    assert decision.drains == []


def test_outage_holds_back_a_pending_drain() -> None:
    """Regression: a pod already hot must not be drained on a tick where the signal is gone."""
    pods = fleet(4, 1)
    pods[0].fault_from, pods[0].fault_low = 0, 0.05
    record(pods, 80, seed=6)
    first = decide(SPEC, views(pods, 70), GuardState(), 350.0)
    assert first.verdicts["decode-0"].state == "hot" and first.drains == []
    for pod in pods:
        pod.missing_from = 0
    second = decide(SPEC, views(pods, 71), first.state, 355.0)
    assert second.drains == [] and second.unavailable is not None


def test_single_hot_tick_does_not_drain_and_degraded_does_not_flap() -> None:
    """Regression (flapping): a lone hot observation between clear ones never drains, and a
    fleet share oscillating around the incident level sets Degraded once instead of toggling."""
    spec = SPEC
    healthy = PodSignals(checked=1000, trips_low_accept=0, trips_high_accept=0)
    bad = PodSignals(checked=1000, trips_low_accept=30, trips_high_accept=0)

    def tick(bad_names: set[str], state: GuardState, t: int) -> tuple[GuardState, bool, int]:
        pods = [
            PodView(f"d{i}", "decode", True, True, None, bad if f"d{i}" in bad_names else healthy)
            for i in range(6)
        ]
        d = decide(spec, pods, state, t * TICK)
        return d.state, d.degraded is not None, len(d.drains)

    state = GuardState()
    drains = 0
    for t in range(20):  # d0 hot once every 4 ticks: 3 clear ticks reset its streak
        state, _, n = tick({"d0"} if t % 4 == 0 else set(), state, t)
        drains += n
    assert drains == 0

    state, flips, last = GuardState(), 0, False
    for t in range(30):  # 4 of 6 bad, then 2 of 6, alternating each tick
        names = {"d0", "d1", "d2", "d3"} if t % 2 == 0 else {"d0", "d1"}
        state, degraded, n = tick(names, state, t)
        assert n == 0, "no drains during a fleet incident"
        flips += degraded != last
        last = degraded
    assert flips == 1


def test_quarantine_unhealthy_pod_is_drained_without_trip_data() -> None:
    """Regression: the engine's own unhealthy-by-quarantine flag must be enough to drain."""
    sick = PodSignals(
        checked=0, trips_low_accept=0, trips_high_accept=0, unhealthy_by_quarantine=True
    )
    ok = PodSignals(checked=500, trips_low_accept=0, trips_high_accept=0)
    pods = [PodView("d0", "decode", True, True, None, sick)] + [
        PodView(f"d{i}", "decode", True, True, None, ok) for i in (1, 2, 3)
    ]
    state = GuardState()
    for t in range(2):
        d = decide(SPEC, pods, state, t * TICK)
        state = d.state
    assert [o.name for o in d.drains] == ["d0"]
    assert d.drains[0].reason == REASON_QUARANTINE


def _hot_pods(n: int, bad: set[str], draining: set[str] = frozenset()) -> list[PodView]:  # type: ignore[assignment]
    hot = PodSignals(checked=2000, trips_low_accept=60, trips_high_accept=0)
    ok = PodSignals(checked=2000, trips_low_accept=0, trips_high_accept=1)
    return [
        PodView(
            f"d{i}",
            "decode",
            True,
            f"d{i}" not in draining,
            10.0 if f"d{i}" in draining else None,
            hot if f"d{i}" in bad else ok,
        )
        for i in range(n)
    ]


def _run(
    spec: AnomalyGuardSpec,
    pods: list[PodView],
    ticks: int = 2,
    state: GuardState | None = None,
    desired: dict[str, int] | None = None,
) -> tuple[list[str], dict[str, str]]:
    state = state or GuardState()
    drained: list[str] = []
    blocked: dict[str, str] = {}
    for t in range(ticks):
        d = decide(spec, pods, state, 1000.0 + t * TICK, desired=desired)
        state = d.state
        drained += [o.name for o in d.drains]
        blocked = d.blocked
    return drained, blocked


def test_floor_never_drains_the_last_serving_instance() -> None:
    """Regression: with one decode instance left, draining it would stop all decoding."""
    pods = _hot_pods(2, {"d0"}, draining={"d1"})
    drained, blocked = _run(SPEC, pods)
    assert drained == [] and "floor" in blocked["d0"]


def test_circuit_breaker_caps_pods_draining_at_once() -> None:
    """Regression: maxDrainingPercent=25 of 8 pods allows 2 draining; a third waits."""
    assert drain_capacity(8, 25) == 2 and drain_capacity(2, 25) == 1 and drain_capacity(4, 0) == 0
    pods = _hot_pods(8, {"d0"}, draining={"d6", "d7"})
    drained, blocked = _run(SPEC, pods)
    assert drained == [] and "circuit breaker" in blocked["d0"]


def test_pods_not_ready_or_missing_count_against_the_circuit_breaker() -> None:
    """Regression (issue 15): only pods out of rotation counted, so a pool with replacements
    still starting (not Ready, or not created yet) could lose another pod to a drain."""
    pods = _hot_pods(8, {"d0"})
    starting = [replace(p, ready=False) if p.name in ("d6", "d7") else p for p in pods]
    drained, blocked = _run(SPEC, starting)
    assert drained == [] and "2 unavailable" in blocked["d0"]
    drained, blocked = _run(SPEC, pods[:6], desired={"decode": 8})  # two being replaced
    assert drained == [] and "circuit breaker" in blocked["d0"]
    assert _run(SPEC, pods, desired={"decode": 8})[0] == ["d0"]


def test_a_restarted_loop_keeps_its_cooldown_and_hourly_budget() -> None:
    """Regression (issue 15): the last drain and the drain count lived in memory only, so an
    operator restart (or a crash loop) reset the cooldown and let drains run unbounded."""
    pods = _hot_pods(8, {"d0"})
    before = GuardState(last_drain={"decode": 990.0}, recent_drains=(990.0,))
    record = GuardState.restored(before.drain_record())
    assert record.last_drain == {"decode": 990.0} and record.recent_drains == (990.0,)
    drained, blocked = _run(SPEC, pods, state=record)
    assert drained == [] and "cooldown" in blocked["d0"]
    spent = GuardState.restored(
        GuardState(recent_drains=tuple(900.0 + t for t in range(6))).drain_record()
    )
    drained, blocked = _run(SPEC, pods, state=spent)  # 6 drains this hour: the default budget
    assert drained == [] and "replacement budget" in blocked["d0"]
    later = GuardState(recent_drains=tuple(t - 3600.0 for t in spent.recent_drains))
    assert _run(SPEC, pods, state=later)[0] == ["d0"]


def test_cooldown_spaces_drains_in_a_pool() -> None:
    """Regression: two pods going bad at once must be drained one cooldown apart, not together."""
    pods = _hot_pods(8, {"d0", "d1"})
    policy = Policy(cooldown_seconds=60.0)
    state, drains = GuardState(), []
    for t in range(16):
        d = decide(SPEC, pods, state, t * TICK, policy)
        state = d.state
        drains += [(o.name, t) for o in d.drains]
        pods = [
            PodView(p.name, p.role, p.ready, False, t * TICK, p.signals)
            if any(o.name == p.name for o in d.drains)
            else p
            for p in pods
        ]
    assert [n for n, _ in drains] == ["d0", "d1"]
    assert (drains[1][1] - drains[0][1]) * TICK >= 60.0


def test_observe_action_reports_without_draining() -> None:
    """Regression: action Observe must never take a pod out of rotation."""
    spec = AnomalyGuardSpec(action=GuardAction.OBSERVE)
    drained, blocked = _run(spec, _hot_pods(8, {"d0"}))
    assert drained == [] and blocked["d0"] == "action is Observe"


def test_pool_alike_pod_is_elevated_not_hot() -> None:
    """Regression: a pod above threshold but no worse than its pool is not an outlier."""
    same = PodSignals(checked=2000, trips_low_accept=10, trips_high_accept=0)
    pool = [PodView(f"d{i}", "decode", True, True, None, same) for i in range(4)]
    verdict = judge_pod(pool[0], pool, SPEC, Policy())
    assert verdict.state == "elevated"


def test_thin_data_is_insufficient() -> None:
    """Regression: 3 trips in 10 checked requests is too little data to judge a pod."""
    thin = PodSignals(checked=10, trips_low_accept=3, trips_high_accept=0)
    pod = PodView("d0", "decode", True, True, None, thin)
    assert judge_pod(pod, [pod], SPEC, Policy()).state == "insufficient"

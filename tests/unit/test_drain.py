"""The act step and the whole tick over an in-memory pod API and a canned metrics source.

The real API server and real pods are exercised in e2e/tests; here the seam is `PodApi`
(list / merge patch / eviction of pods) and `MetricsSource` (an Observation per tick), both
from tests/fakes.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cas_operator.anomaly.act import LoopState, anomaly_tick
from cas_operator.anomaly.drain import (
    ANNOTATION_DRAIN_REASON,
    ANNOTATION_DRAIN_STATE,
    ANNOTATION_DRAINING_SINCE,
    DrainPolicy,
    next_step,
)
from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec, GuardAction
from cas_operator.autoscale.controller import PoolCounts, PressureState, ScaleBounds, suggest_scale
from cas_operator.observe.types import PodSignals
from cas_operator.types import rfc3339
from tests.fakes import CannedMetrics, MemoryPods, RecordingRouters

T0 = 1_800_000_000.0  # wall-clock epoch seconds


def engine_pod(name: str, role: str = "decode", **annotations: str) -> dict[str, Any]:
    labels = {
        c.LABEL_NAME: "demo",
        c.LABEL_APP_NAME: c.APP_ENGINE,
        c.LABEL_ROLE: role,
    }
    if not annotations:
        labels[c.LABEL_SERVING] = "true"
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": labels,
            "annotations": dict(annotations),
        },
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


CORRUPT = PodSignals(checked=2000, trips_low_accept=80, trips_high_accept=0, running=4)


def fleet(n: int = 6) -> MemoryPods:
    return MemoryPods([engine_pod(f"d{i}") for i in range(n)] + [engine_pod("p0", "prefill")])


def tick(
    api: MemoryPods,
    source: CannedMetrics,
    state: LoopState,
    t: float,
    spec: AnomalyGuardSpec | None = None,
) -> Any:
    return anomaly_tick(
        api,
        source,
        name="demo",
        namespace="ns",
        spec=spec or AnomalyGuardSpec(),
        state=state,
        now=T0 + t,
    )


def test_corrupted_pod_is_taken_out_of_rotation_then_replaced() -> None:
    """Regression: the full act sequence - label removed with reason and time, wait while it
    still runs requests, delete once they reach zero - with an event for each step."""
    api, source, state = fleet(), CannedMetrics(), LoopState()
    source.by_name["d2"] = CORRUPT
    first = tick(api, source, state, 0)
    assert first.draining == [] and ("patch", "d2") not in api.calls  # hysteresis: 1 tick
    second = tick(api, source, state, 5)
    pod = api.pod("d2")["metadata"]
    assert c.LABEL_SERVING not in pod["labels"]
    assert pod["annotations"][ANNOTATION_DRAINING_SINCE] == rfc3339(T0 + 5)
    assert pod["annotations"][ANNOTATION_DRAIN_REASON] == "low_accept_length"
    assert [e[1] for e in second.events].count("PodDraining") == 1
    assert second.draining[0]["pod"] == "d2" and second.draining[0]["state"] == "Draining"
    assert api.pod("d3")["metadata"]["labels"][c.LABEL_SERVING] == "true"

    tick(api, source, state, 30)  # still 4 running: wait
    assert api.has("d2")
    source.by_name["d2"] = PodSignals(checked=0, trips_low_accept=0, trips_high_accept=0, running=0)
    done = tick(api, source, state, 35)
    assert not api.has("d2") and ("evict", "d2") in api.calls
    assert any(e[1] == "PodReplaced" and "no running requests" in e[2] for e in done.events)
    assert done.draining == []


def test_a_disruption_budget_keeps_a_drained_pod_until_it_allows_the_eviction() -> None:
    """Drains and replacements go through the Eviction API, so PodDisruptionBudgets hold: a
    refused eviction leaves the pod out of rotation, marks it once (one Warning event, shown
    in status.draining) and is retried every tick until the budget allows it."""
    api, source, state = fleet(), CannedMetrics(), LoopState()
    source.by_name["d2"] = replace(CORRUPT, running=0.0)
    api.budget_refuses.add("d2")
    blocked = []
    for t in (0, 5, 25, 30):
        result = tick(api, source, state, t)
        blocked += [(t, e[1]) for e in result.events if e[1] == "EvictionBlocked"]
    assert api.has("d2") and api.calls.count(("evict", "d2")) == 2  # at 25 s and 30 s
    assert blocked == [(25, "EvictionBlocked")]  # once, at the first refusal
    assert result.draining[0]["evictionBlockedSince"] == rfc3339(T0 + 25)
    api.budget_refuses.clear()
    tick(api, source, state, 35)
    assert not api.has("d2")


def test_grace_period_bounds_the_wait() -> None:
    """Regression: a pod whose requests never finish (or whose metrics vanished) must still be
    replaced once the grace period ends, and not before the minimum wait."""
    policy = DrainPolicy(min_wait_seconds=15, grace_seconds=120)
    pod = engine_pod("d0", **{ANNOTATION_DRAINING_SINCE: rfc3339(T0)})
    assert next_step(pod, 0.0, GuardAction.REPLACE, T0 + 5, policy) == "wait"
    assert next_step(pod, 0.0, GuardAction.REPLACE, T0 + 16, policy) == "delete"
    assert next_step(pod, 2.0, GuardAction.REPLACE, T0 + 100, policy) == "wait"
    assert next_step(pod, None, GuardAction.REPLACE, T0 + 100, policy) == "wait"
    # Regression: an unknown running count (metrics missing) was removed once the grace ended.
    assert next_step(pod, None, GuardAction.REPLACE, T0 + 10_000, policy) == "wait"
    assert next_step(pod, 2.0, GuardAction.REPLACE, T0 + 121, policy) == "delete"
    assert next_step(engine_pod("d1"), 0.0, GuardAction.REPLACE, T0, policy) == "none"


def test_drain_action_holds_the_pod_for_inspection_then_releases_it() -> None:
    """Regression: action Drain must keep the pod (out of rotation) instead of deleting it,
    report it once as held, and delete it only after the hold cap."""
    api, source, state = fleet(), CannedMetrics(), LoopState()
    spec = AnomalyGuardSpec(action=GuardAction.DRAIN)
    source.by_name["d1"] = CORRUPT
    for t in (0, 5):
        tick(api, source, state, t, spec)
    source.by_name["d1"] = PodSignals(checked=0, trips_low_accept=0, trips_high_accept=0, running=0)
    held = tick(api, source, state, 30, spec)
    assert api.has("d1")
    assert api.pod("d1")["metadata"]["annotations"][ANNOTATION_DRAIN_STATE] == "Held"
    assert [e[1] for e in held.events] == ["PodHeld"]
    again = tick(api, source, state, 60, spec)
    assert "PodHeld" not in [e[1] for e in again.events] and again.draining[0]["state"] == "Held"
    tick(api, source, state, 5 + 3600, spec)
    assert not api.has("d1")


def test_restarted_operator_resumes_drains_from_the_pods() -> None:
    """Regression: after a restart (empty LoopState) a drain in progress must be finished from
    the pod's annotations, counted against the breaker, and never started twice."""
    api = fleet(4)
    since = rfc3339(T0 - 60)
    api.add(
        engine_pod(
            "d0", **{ANNOTATION_DRAINING_SINCE: since, ANNOTATION_DRAIN_REASON: "low_accept_length"}
        )
    )
    source = CannedMetrics()
    source.by_name["d0"] = PodSignals(checked=0, trips_low_accept=0, trips_high_accept=0, running=2)
    source.by_name["d1"] = CORRUPT
    state = LoopState()
    first = tick(api, source, state, 0)
    assert first.draining[0]["pod"] == "d0" and first.draining[0]["runningRequests"] == 2
    second = tick(api, source, state, 5)  # d1 hot twice, but d0 fills the 25 % breaker of 4
    assert ("patch", "d1") not in api.calls
    assert "circuit breaker" in second.decision.blocked["d1"]
    source.by_name["d0"] = PodSignals(checked=0, trips_low_accept=0, trips_high_accept=0, running=0)
    tick(api, source, state, 10)
    assert not api.has("d0") and [n for op, n in api.calls if op == "patch"] == []


def test_observe_action_and_outage_touch_nothing() -> None:
    """Regression: Observe must not write to pods; a metrics outage must not write either and
    must surface as 'signal unavailable'."""
    api, source = fleet(), CannedMetrics()
    source.by_name["d2"] = CORRUPT
    state = LoopState()
    spec = AnomalyGuardSpec(action=GuardAction.OBSERVE)
    for t in (0, 5, 10):
        result = tick(api, source, state, t, spec)
    assert api.calls == [] and "action is Observe" in result.decision.blocked["d2"]

    source.error = "prometheus unavailable: refused"
    state = LoopState()
    for t in (0, 5, 10):
        result = tick(api, source, state, t)
    assert api.calls == [] and result.unavailable is not None
    assert "unavailable" in result.unavailable


def test_fleet_incident_reports_degraded_and_drains_nothing() -> None:
    """Regression: most pods bad together -> Degraded with a reason, no pod touched."""
    api, source, state = fleet(), CannedMetrics(), LoopState()
    for i in range(5):
        source.by_name[f"d{i}"] = CORRUPT
    for t in (0, 5, 10):
        result = tick(api, source, state, t)
    assert api.calls == [] and result.degraded is not None and "fleet-wide" in result.degraded
    assert result.pool_rate["decode"] is not None and result.pool_rate["decode"] > 0.01


def test_terminating_pods_are_ignored() -> None:
    """Regression: a pod already being deleted must be neither observed nor acted on."""
    api, source = fleet(2), CannedMetrics()
    api.pod("d0")["metadata"]["deletionTimestamp"] = rfc3339(T0)
    tick(api, source, LoopState(), 0)
    assert source.asked == [["d1", "p0"]]


def test_tick_views_feed_a_prefill_scale_hint_under_sustained_prefill_queueing() -> None:
    """Regression: pressure must carry across ticks and the caller must get a prefill scale-up
    hint once prefill queueing with idle decode is sustained. The anomaly tick hands over the
    pods with their signals; the replica controller (autoscale) keeps the streaks."""
    api, source, state = fleet(4), CannedMetrics(), LoopState()
    source.by_name["p0"] = PodSignals(queued=9.0, aborted=0.0, running=8.0)
    for i in range(4):
        source.by_name[f"d{i}"] = PodSignals(
            checked=500,
            trips_low_accept=0,
            trips_high_accept=0,
            queued=0.0,
            running=1.0,
            token_usage=0.2,
        )
    counts = PoolCounts(prefill=1, decode=4, prefill_ready=1, decode_ready=4)
    hints, pressure = [], PressureState()
    for t in range(3):
        result = anomaly_tick(
            api,
            source,
            name="demo",
            namespace="ns",
            spec=AnomalyGuardSpec(),
            state=state,
            now=T0 + 5 * t,
        )
        scale = suggest_scale(result.views, counts, ScaleBounds(ratio_max=1.0), pressure)
        pressure = scale.state
        hints.append(scale.hint)
    assert hints[:2] == [None, None]
    assert hints[2] is not None and (hints[2].prefill, hints[2].decode) == (2, 4)
    assert api.calls == []


def test_draining_pods_are_deregistered_from_routers_until_gone() -> None:
    """Regression: the SGLang router keeps a worker whose pod only lost the label; every tick
    must make sure no router lists a draining pod (and say so once), healthy pods untouched."""
    api, source, state, routers = fleet(), CannedMetrics(), LoopState(), RecordingRouters()
    source.by_name["d2"] = CORRUPT
    api.pod("d2")["status"]["podIP"] = "127.10.0.3"
    results = [
        anomaly_tick(
            api,
            source,
            name="demo",
            namespace="ns",
            spec=AnomalyGuardSpec(),
            state=state,
            now=T0 + t,
            routers=routers,
        )
        for t in (0, 5, 10)
    ]
    assert routers.removed == ["http://127.10.0.3:30000"]  # d2's URL, once
    assert [e[1] for e in results[1].events].count("WorkerDeregistered") == 1
    assert "WorkerDeregistered" not in [e[1] for e in results[2].events]
    assert [e[1] for e in results[0].events] == []


def test_pods_being_deleted_leave_every_router_at_once() -> None:
    """Regression (issue 15): the SGLang router (0.3.2) kept sending a deleted pod new
    requests (6 of 12 within 7 s, measured through the real router), so its preStop could
    not settle and the grace cut what it ran. A pod with a deletionTimestamp (a scale-down, a
    retired revision, an eviction) is deregistered on the next tick, without being judged."""
    api, source, routers = fleet(), CannedMetrics(), RecordingRouters()
    api.pod("d4")["status"]["podIP"] = "127.10.0.5"
    api.pod("d4")["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    result = anomaly_tick(
        api, source, name="demo", namespace="ns", spec=AnomalyGuardSpec(),
        state=LoopState(), now=T0, routers=routers,
    )  # fmt: skip
    assert routers.removed == ["http://127.10.0.5:30000"]
    assert [e[1] for e in result.events] == ["WorkerDeregistered"]
    assert "d4" not in {v.name for v in result.views}  # not judged: it is going anyway
    assert api.calls == []  # and not touched


def lws_group(index: int, size: int = 4) -> list[dict[str, Any]]:
    """One multi-node decode instance as LWS creates it: leader (serving) + workers."""
    pods = []
    for worker in range(size):
        pod = engine_pod(f"g{index}-{worker}" if worker else f"g{index}")
        pod["metadata"]["labels"][c.LWS_WORKER_INDEX_LABEL] = str(worker)
        if worker:
            del pod["metadata"]["labels"][c.LABEL_SERVING]  # the worker template never serves
        pods.append(pod)
    return pods


def test_multi_node_instances_are_judged_and_replaced_by_their_leader() -> None:
    """Regression: LWS worker pods (no HTTP server, never in rotation) were scraped and judged
    like instances. Now only leaders are observed; a bad instance's leader is drained and
    deleted (LWS then recreates the whole group) and its workers are never touched."""
    api = MemoryPods([p for i in range(4) for p in lws_group(i)])
    source, state = CannedMetrics(), LoopState()
    source.by_name["g1"] = CORRUPT
    tick(api, source, state, 0)
    assert source.asked[-1] == ["g0", "g1", "g2", "g3"]
    tick(api, source, state, 5)
    assert c.LABEL_SERVING not in api.pod("g1")["metadata"]["labels"]
    source.by_name["g1"] = PodSignals(checked=0, trips_low_accept=0, trips_high_accept=0, running=0)
    tick(api, source, state, 30)
    assert not api.has("g1")
    assert all(api.has(f"g1-{w}") for w in (1, 2, 3))
    assert {name for kind, name in api.calls} == {"g1"}

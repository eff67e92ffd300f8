"""The fleet tick: one pod LIST per namespace per tick, one anomaly_tick and one autoscale step
per resource over that snapshot, findings handed to the passes (the one status writer) and a
pass asked for only when they changed, failures isolated.

The seams are a pod store with the `Kube` calls the loop uses and a canned metrics source;
the real API server runs it in e2e/tests (the operator process).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cas_operator.anomaly.drain import ANNOTATION_DRAINING_SINCE
from cas_operator.api import constants as c
from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale.loop import Autoscaler
from cas_operator.autoscale.signals import HIT_SETTLE_S
from cas_operator.desired.recommend import planner_workload
from cas_operator.fleet_tick import FleetTick, PodSnapshot
from cas_operator.observe.types import PodSignals
from cas_operator.types import rfc3339
from tests.fakes import HEALTHY, CannedMetrics, MemoryPods

CORRUPT = PodSignals(checked=2000, trips_low_accept=80, trips_high_accept=0, running=4)
T0 = 1_800_000_000.0


def pod(owner: str, namespace: str, name: str, role: str = "decode") -> dict[str, Any]:
    labels = {
        c.LABEL_NAME: owner,
        c.LABEL_APP_NAME: c.APP_ENGINE,
        c.LABEL_ROLE: role,
        c.LABEL_SERVING: "true",
    }
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": {}},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def resource(name: str, namespace: str = "ns", status: dict[str, Any] | None = None) -> Any:
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"model": {"name": "glm-5"}},
        "status": status or {},
    }


def guard(store: MemoryPods, source: CannedMetrics) -> tuple[FleetTick, list[tuple[str, Any]]]:
    posted: list[tuple[str, Any]] = []
    g = FleetTick(
        store,  # type: ignore[arg-type]
        lambda: source,
        lambda body, event: posted.append((body["metadata"]["name"], event)),
    )
    return g, posted


def sections(tick: FleetTick, name: str) -> dict[str, Any]:
    """The status sections the tick handed to the passes for resource `name`."""
    found = tick.measured[f"uid-{name}"].sections
    assert found is not None
    return found


def fleets() -> MemoryPods:
    pods = [
        pod(owner, ns, f"{owner}-d{i}")
        for owner, ns in (("a", "ns"), ("b", "ns"), ("c", "other"))
        for i in range(5)
    ]
    return MemoryPods(pods, forbid_list=True)


def test_one_pod_list_per_namespace_for_any_number_of_resources() -> None:
    """Regression: a kopf timer per resource listed pods per resource (20 LISTs/s at N=200)."""
    store, source = fleets(), CannedMetrics()
    g, _ = guard(store, source)
    g.tick([resource("a"), resource("b"), resource("c", "other")], now=T0)
    assert sorted(store.lists) == ["ns", "other"]


def test_the_metrics_source_is_asked_once_per_tick_and_window() -> None:
    """Regression: each resource queried Prometheus itself (12 PromQL queries per resource per
    tick: ~2,400 per tick at N=200). One batched observation per window serves every resource,
    each reading only its own pods."""
    store, source = fleets(), CannedMetrics()
    source.by_name["b-d1"] = CORRUPT
    g, _ = guard(store, source)
    slow = resource("c", "other")
    slow["spec"]["anomalyGuard"] = {"windowSeconds": 600}
    g.tick([resource("a"), resource("b"), slow], now=T0)
    windows = sorted(w for w, _ in source.calls)
    assert len(source.calls) == 2 and windows[1] == 600.0
    batched = dict(source.calls)[windows[0]]
    assert batched == sorted(f"{o}-d{i}" for o in "ab" for i in range(5))


def test_a_failed_batch_reads_as_signal_unavailable_for_every_resource() -> None:
    store, source = fleets(), CannedMetrics()
    source.error = "prometheus unavailable: refused"
    g, _ = guard(store, source)
    g.tick([resource("a"), resource("b")], now=T0)
    assert all(sections(g, r)["anomaly"]["signalUnavailable"] for r in "ab")


def test_a_pass_is_asked_for_only_when_the_findings_changed() -> None:
    """Regression: an unchanged anomaly status must not be rewritten every tick per resource
    (the passes write status; the tick asks for one only when its findings changed)."""
    store, source = fleets(), CannedMetrics()
    g, _ = guard(store, source)
    resources = [resource("a"), resource("b")]
    assert g.tick(resources, now=T0) == 2
    assert sections(g, "a")["anomaly"]["fleetWide"] is None and sections(g, "a")["draining"] == []
    assert g.tick(resources, now=T0 + 10) == 0
    assert store.status_patches == []  # the tick itself never writes status


def test_a_lagging_status_copy_does_not_ask_for_the_same_pass_again() -> None:
    """Regression (bench-operator N=200: 12.8 status writes per resource in 13 ticks): the
    resource copy the tick reads lags the passes' writes under load; the tick compares with
    its own last findings, not with that copy."""
    store, source = fleets(), CannedMetrics()
    g, _ = guard(store, source)
    stale = [resource("a")]  # the watch has not delivered the pass's write yet
    assert g.tick(stale, now=T0) == 1
    assert g.tick(stale, now=T0 + 5) == 0 and g.tick(stale, now=T0 + 10) == 0


def test_a_corrupted_pod_is_drained_only_in_its_own_resource() -> None:
    """The per-resource decision still holds inside one shared snapshot: b's bad pod is
    drained after the hysteresis ticks; a's pods (same namespace) are untouched."""
    store, source = fleets(), CannedMetrics()
    source.by_name["b-d3"] = CORRUPT
    g, posted = guard(store, source)
    for t in (0, 5):
        g.tick([resource("a"), resource("b")], now=T0 + t)
    drained = {
        n
        for (_, n), p in store.pods.items()
        if ANNOTATION_DRAINING_SINCE in p["metadata"]["annotations"]
    }
    assert drained == {"b-d3"}
    assert ("b", ("Warning", "PodDraining", "pod b-d3 out of rotation: low_accept_length")) in [
        (name, e) for name, e in posted
    ]
    assert sections(g, "b")["draining"][0]["pod"] == "b-d3"


def test_a_drain_is_recorded_in_status_and_a_restarted_tick_keeps_its_cooldown() -> None:
    """Regression (issue 15): a restarted operator forgot its last drain and drained again
    at once; the record now travels in status.anomaly."""
    store, source = fleets(), CannedMetrics()
    source.by_name["b-d3"] = source.by_name["b-d1"] = CORRUPT
    spec = {"model": {"name": "glm-5"}, "anomalyGuard": {"maxDrainingPercent": 100}}
    g, _ = guard(store, source)
    for t in (0, 5):
        g.tick([{**resource("b"), "spec": spec}], now=T0 + t)
    record = sections(g, "b")["anomaly"]
    assert record["lastDrain"] == {"decode": rfc3339(T0 + 5)}
    assert record["recentDrains"] == [rfc3339(T0 + 5)]
    restarted, _ = guard(store, source)
    for t in (10, 15, 20):
        restarted.tick([{**resource("b", status={"anomaly": record}), "spec": spec}], now=T0 + t)
    drained = [n for (_, n), p in store.pods.items() if ANNOTATION_DRAINING_SINCE in
               p["metadata"]["annotations"]]  # fmt: skip
    assert len(drained) == 1, drained  # the second bad pod waits for the cooldown


def test_a_failing_event_post_does_not_cost_the_findings() -> None:
    """Regression: kopf.event raised outside kopf's handlers (no event queue) before the status
    patch, so every tick with events (a drain start, a deletion) wrote no status."""
    store, source = fleets(), CannedMetrics()
    source.by_name["b-d3"] = CORRUPT

    def refuse(body: Any, event: Any) -> None:
        raise LookupError("no event queue here")

    g = FleetTick(store, lambda: source, refuse)  # type: ignore[arg-type]
    for t in (0, 5):
        g.tick([resource("b")], now=T0 + t)
    assert [d["pod"] for d in sections(g, "b")["draining"]] == ["b-d3"]


def test_one_failing_resource_does_not_stop_the_others() -> None:
    """Regression guard: an exception in one resource's tick is logged, the rest proceed."""
    store, source = fleets(), CannedMetrics()

    class Failing(Autoscaler):
        def step(self, uid: str, *args: Any, **kwargs: Any) -> Any:
            if uid == "uid-a":
                raise RuntimeError("API server said no")
            return super().step(uid, *args, **kwargs)

    g, _ = guard(store, source)
    g.autoscaler = Failing()
    assert g.tick([resource("a"), resource("b")], now=T0) == 1
    assert set(g.measured) == {"uid-b"}


def test_a_changed_anomaly_asks_for_a_pass_with_the_finding_in_memory() -> None:
    """Regression: conditions fold status.anomaly in; a pass reading the event's stale copy
    kept Degraded/FleetWideAnomaly wrong until the 30 s timer. The loop now hands its finding
    over in memory and asks for a pass when it changed (and not when it did not)."""
    store, source = fleets(), CannedMetrics()
    changed: list[str] = []
    g, _ = guard(store, source)
    g.on_change = lambda r: changed.append(r["metadata"]["name"])
    g.tick([resource("a")], now=T0)
    assert changed == ["a"]
    assert g.measured_for("uid-a", {}).anomaly == sections(g, "a")["anomaly"]
    g.tick([resource("a", status=sections(g, "a"))], now=T0 + 10)
    assert changed == ["a"]


def test_state_of_deleted_resources_is_forgotten() -> None:
    store, source = fleets(), CannedMetrics()
    g, _ = guard(store, source)
    g.tick([resource("a"), resource("b")], now=T0)
    assert set(g.states) == {"uid-a", "uid-b"}
    g.tick([resource("a")], now=T0 + 10)
    assert set(g.states) == {"uid-a"}


def test_snapshot_filters_by_every_selector_label() -> None:
    store = fleets()
    snap = PodSnapshot.take(store, ["ns"])  # type: ignore[arg-type]
    names = [p["metadata"]["name"] for p in snap.list("Pod", "ns", {c.LABEL_NAME: "b"})]
    assert names == [f"b-d{i}" for i in range(5)]
    assert snap.list("Pod", "ns", {c.LABEL_NAME: "b", c.LABEL_ROLE: "prefill"}) == []


AUTO = {
    "model": {"name": "glm-5"},
    "ratio": {"mode": "Auto", "gpuBudget": 64},
    "workload": {"requestRate": 2.0},
}


def pd_fleet() -> tuple[MemoryPods, CannedMetrics]:
    pods = [pod("a", "ns", "a-p0", "prefill"), pod("a", "ns", "a-d0"), pod("a", "ns", "a-d1")]
    source = CannedMetrics()
    source.by_name["a-p0"] = PodSignals(prompt_tokens=1000.0, cached_tokens=800.0, queued=0.0)
    for name in ("a-d0", "a-d1"):
        source.by_name[name] = replace(HEALTHY, requests=60.0, token_usage=0.4)
    return MemoryPods(pods, forbid_list=True), source


def test_auto_mode_measures_load_steps_replicas_and_asks_for_a_pass() -> None:
    """Auto: status.autoscaler carries the measured load and the replicas the operator owns;
    the reconcile is asked to run (it reads the counts from `measured_for`)."""
    store, source = pd_fleet()
    changed: list[str] = []
    g, _ = guard(store, source)
    g.on_change = lambda r: changed.append(r["metadata"]["name"])
    res = resource("a")
    res["spec"] = AUTO
    g.tick([res], now=T0)
    entry = sections(g, "a")["autoscaler"]
    assert entry["observed"]["arrivalRate"] == 120.0 / 300.0  # two decodes over the 300 s window
    assert entry["observed"]["hitRate"] == 0.8
    assert (entry["prefill"], entry["decode"]) == g.measured_for("uid-a", {}).auto_replicas
    assert changed == ["a"]


def test_auto_replicas_survive_an_operator_restart_through_status() -> None:
    g, _ = guard(*pd_fleet())
    kept = {"autoscaler": {"prefill": 3, "decode": 2, "reason": "earlier"}}
    assert g.measured_for("uid-a", kept).auto_replicas == (3, 2)


def _shaped(source: CannedMetrics, prompt: float, generated: float) -> None:
    """Prefill a-p0 and decodes a-d0/a-d1 measure this many tokens per request."""
    source.by_name["a-p0"] = PodSignals(requests=10.0, prompt_tokens=10 * prompt)
    for name in ("a-d0", "a-d1"):
        source.by_name[name] = replace(HEALTHY, requests=60.0, generation_tokens=60 * generated)


def _shape(tick: FleetTick) -> tuple[float | None, float | None]:
    observed = tick.measured["uid-a"].observed
    assert observed is not None
    return observed.avg_input_tokens, observed.avg_output_tokens


def test_the_request_shape_is_held_within_its_band_and_survives_a_restart() -> None:
    """Regression (issue 18): the measured request shape, which sizes the routers' admission
    limits, came on a geometric grid: a prompt of 70,600 tokens was sized as 87,581 (a limit
    ~20% low) and noise around a grid line rolled the routers; and a restarted operator sized
    the limits for the declared shape until it measured again, rolling every fleet's routers
    twice. Now a length moves only when the measured one is over 3% longer or over 10%
    shorter than the kept one, a quiet window keeps it, and a restarted operator resumes it
    from status."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    _shaped(source, 70_600.0, 1_500.0)
    g.tick([resource("a")], now=T0)
    assert _shape(g) == (70_600.0, 1_500.0)
    _shaped(source, 72_000.0, 1_400.0)  # 2% longer, 7% shorter: kept, the limit does not move
    g.tick([resource("a")], now=T0 + 30)
    assert _shape(g) == (70_600.0, 1_500.0)
    _shaped(source, 72_000.0, 1_800.0)  # outputs 20% longer: that length moves
    g.tick([resource("a")], now=T0 + 60)
    assert _shape(g) == (70_600.0, 1_800.0)
    source.by_name.clear()  # a quiet window measures no shape: the kept one stays
    g.tick([resource("a")], now=T0 + 90)
    assert _shape(g) == (70_600.0, 1_800.0)

    status = {"admission": {"requestShape": {"inputTokens": 70_600.0, "outputTokens": 1_800.0}}}
    restarted, _ = guard(store, source)
    kept = restarted.measured_for("uid-a", status).observed
    assert kept is not None and (kept.avg_input_tokens, kept.avg_output_tokens) == (
        70_600.0,
        1_800.0,
    )
    _shaped(source, 72_000.0, 1_700.0)
    restarted.tick([resource("a", status=status)], now=T0 + 120)
    assert _shape(restarted) == (70_600.0, 1_800.0)  # resumed from status, then held


def test_fixed_mode_writes_no_autoscaler_status() -> None:
    store, source = pd_fleet()
    g, _ = guard(store, source)
    g.tick([resource("a")], now=T0)
    assert "autoscaler" not in sections(g, "a")
    kept = g.measured["uid-a"]
    assert kept.auto_replicas is None and kept.anomaly is not None
    # only the request shape is kept (admission control sizes for it), nothing else of the load
    assert kept.observed is not None and kept.observed.arrival_rate is None


def test_pods_are_listed_in_pages_and_slimmed_as_they_arrive() -> None:
    """Regression guard for the operator's memory at N=200: the fleet LIST is paged and each
    pod keeps only what the loop reads (no spec, no managedFields)."""
    from cas_operator.fleet_tick import slim_pod
    from cas_operator.kube import Kube

    pages = {"": (["a", "b"], "t1"), "t1": (["c"], "")}
    asked: list[list[tuple[str, str]]] = []

    def fake_call(method: str, path: str, *, query: list[tuple[str, str]]) -> Any:
        asked.append(query)
        names, token = pages[dict(query).get("continue", "")]
        items = [
            {**pod("x", "ns", n), "spec": {"containers": [{"args": ["--big"] * 100}]}}
            for n in names
        ]
        for item in items:
            item["metadata"]["managedFields"] = [{"manager": "kwok"}] * 50
        return {"items": items, "metadata": {"continue": token}}

    kube = Kube.__new__(Kube)
    kube._call = fake_call  # type: ignore[method-assign,assignment]
    got = kube.list_labelled("Pod", "ns", c.LABEL_NAME, slim_pod, page_size=2)
    assert [p["metadata"]["name"] for p in got] == ["a", "b", "c"]
    assert [dict(q).get("limit") for q in asked] == ["2", "2"]
    assert all("spec" not in p and "managedFields" not in p["metadata"] for p in got)
    assert got[0]["status"]["podIP"] == "127.0.0.1"
    assert got[0]["metadata"]["labels"][c.LABEL_SERVING] == "true"


def test_a_canary_is_judged_apart_never_drained_and_its_anomaly_aborts_the_rollout() -> None:
    """Regression (issue 16): the anomaly loop pooled a canary's pods with the stable ones (a
    bad canary raised the stable baseline and was drained and replaced by the same bad
    engine), and Auto sized the fleet from one revision's counts. Now the canary's pods are
    judged among themselves, never drained, their anomaly aborts the rollout, and Auto keeps
    its counts while the canary runs."""
    stable = [pod("a", "ns", n, role) for n, role in (("a-p0", "prefill"), ("a-d0", "decode"),
                                                      ("a-d1", "decode"))]  # fmt: skip
    canary = [pod("a", "ns", n, role) for n, role in (("a-cp", "prefill"), ("a-cd", "decode"))]
    for p, revision in [(p, "r1") for p in stable] + [(p, "r2") for p in canary]:
        p["metadata"]["labels"][c.LABEL_REVISION] = revision
    store, source = MemoryPods(stable + canary, forbid_list=True), CannedMetrics()
    source.by_name["a-cd"] = CORRUPT
    g, posted = guard(store, source)
    res = resource("a", status={
        "revision": "r2",
        "autoscaler": {"prefill": 1, "decode": 2, "reason": "earlier"},
        "rollout": {"phase": "Progressing", "stableRevision": "r1", "canaryRevision": "r2"},
    })  # fmt: skip
    res["spec"] = {**AUTO, "rollout": {"strategy": "Canary", "steps": [{"weight": 20}]}}
    g.tick([res], now=T0)
    assert g.measured["uid-a"].auto_replicas == (1, 2)
    assert "held" in sections(g, "a")["autoscaler"]
    for i in (1, 2):
        g.tick([res], now=T0 + 5 * i)
    measured = g.measured["uid-a"]
    assert measured.rollout is not None and measured.rollout.phase.value == "Aborted"
    assert "canary anomaly" in measured.rollout.reason and "a-cd" in measured.rollout.reason
    assert ("patch", "a-cd") not in store.calls  # never drained
    assert any(event[1] == "RolloutAborted" for _, event in posted)


def test_the_routers_refusals_reach_status() -> None:
    """Regression (issue 18): the routers' 429s were invisible to the operator (under admission
    the engines' finished requests are only what was let in). The tick reads every router
    pod's 429s with the engines' signals in the same batch and hands them on: Auto's observed
    load shows them, and status.admission (from the plan the passes build on it)."""
    store, source = pd_fleet()
    router = pod("a", "ns", "a-router-x", c.ROLE_ROUTER)
    router["metadata"]["labels"][c.LABEL_APP_NAME] = c.APP_ROUTER
    store.pods[("ns", "a-router-x")] = router
    source.by_name["a-router-x"] = PodSignals(responses=400.0, refused=300.0)
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    g.tick([res], now=T0)
    assert "a-router-x" in source.calls[0][1]  # one batch: engines and routers
    entry = sections(g, "a")["autoscaler"]
    assert entry["observed"]["refusedPerSecond"] == 1.0  # 300 over the 300 s window
    kept = g.measured["uid-a"].observed
    assert kept is not None and kept.refused_rate == 1.0
    # a router that answered but refused nothing: zero
    source.by_name["a-router-x"] = PodSignals(responses=400.0)
    g.tick([res], now=T0 + 30)
    assert sections(g, "a")["autoscaler"]["observed"]["refusedPerSecond"] == 0.0
    # Fixed mode keeps the refusals too (status.admission shows them in every mode)
    res["spec"] = {"model": {"name": "glm-5"}}
    source.by_name["a-router-x"] = PodSignals(responses=400.0, refused=60.0)
    g.tick([res], now=T0 + 60)
    fixed = g.measured["uid-a"].observed
    assert fixed is not None and fixed.refused_rate == 0.2


def test_auto_plans_for_the_last_unthrottled_rate_while_the_routers_refuse() -> None:
    """Regression (issue 18): behind the routers' limit the loop measured only the admitted
    rate and the planner sized the fleet down to the limit that throttled it. While a router
    refuses, the plan's rate is the last unthrottled window's (`status.autoscaler.observed.
    demandRate`); the rate is kept in status, so a restarted operator holds it too."""
    store, source = pd_fleet()
    store.add(pod("a", "ns", "a-r0", "router"))
    source.by_name["a-r0"] = PodSignals(responses=120.0, refused=0.0)
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    g.tick([res], now=T0)
    entry = sections(g, "a")["autoscaler"]
    assert entry["unthrottledArrivalRate"] == 0.4 and "demandRate" not in entry["observed"]
    for name in ("a-d0", "a-d1"):  # a quarter of the arrivals get in, the rest are refused
        source.by_name[name] = replace(HEALTHY, requests=15.0, token_usage=0.4)
    source.by_name["a-r0"] = PodSignals(responses=300.0, refused=270.0)
    g.tick([res], now=T0 + 30)
    entry = sections(g, "a")["autoscaler"]
    assert entry["observed"]["arrivalRate"] == 0.1 and entry["observed"]["demandRate"] == 0.4
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.demand_rate == 0.4
    restarted, _ = guard(store, source)
    restarted.tick([resource("a", status={"autoscaler": entry}) | {"spec": AUTO}], now=T0 + 60)
    assert sections(restarted, "a")["autoscaler"]["observed"]["demandRate"] == 0.4


def test_a_rising_arrival_rate_is_planned_one_pod_start_ahead() -> None:
    """Regression (issue 39, real sessions' ramp): the planner sized for the last window's rate
    while every move waited a pod start, so the fleet lagged a rising load all along. The loop
    keeps each tick's arrival rate; while they rise, the plan's load carries where the rate
    will be one pod start from now (`status.autoscaler.observed.forecastRate`); a flat load
    carries none."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    for i in range(24):  # arrivals rising from 0.40 to 0.86 req/s over 11.5 minutes
        for name in ("a-d0", "a-d1"):
            source.by_name[name] = replace(HEALTHY, requests=60.0 + 3.0 * i, token_usage=0.4)
        g.tick([res], now=T0 + 30.0 * i)
    observed = sections(g, "a")["autoscaler"]["observed"]
    assert observed["arrivalRate"] == 0.86
    # 0.02 req/s more every 30 s, over the default pod start (no pod measured one): 600 s
    assert observed["forecastRate"] == pytest.approx(0.86 + 0.02 / 30.0 * 600.0, rel=0.05)
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.forecast_rate == observed["forecastRate"]
    flat, _ = guard(*pd_fleet())
    for i in range(24):
        flat.tick([res], now=T0 + 30.0 * i)
    assert "forecastRate" not in sections(flat, "a")["autoscaler"]["observed"]
    # the steady rise is a trend, not variation: the decode KV cliff is not widened for it
    assert observed["rateVariation"] == 0.0 and planned.rate_cv == 0.0


def test_the_trend_reads_the_rate_of_the_short_window_the_engines_are_counted_over() -> None:
    """Regression (issue 39, real sessions' ramp with the operator's default 300-s window): the
    trend read the window's rate, whose consecutive readings overlap for 5 minutes, so it found
    three independent readings in 15 minutes and planned a ramp late (73% of the online bound
    against 87% with the trend read from 60-s rates). The loop adds each tick's rate over the
    short window (`recent_requests`, `signals.trend_reading`) to its history: a rise the
    window's rate does not show yet is planned for."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    for i in range(24):  # the last minute's rate rises 0.2 -> 0.66 req/s; the window's is flat
        for name in ("a-d0", "a-d1"):
            source.by_name[name] = replace(
                HEALTHY, requests=60.0, recent_requests=6.0 + 0.6 * i, token_usage=0.4
            )
        g.tick([res], now=T0 + 30.0 * i)
    observed = sections(g, "a")["autoscaler"]["observed"]
    assert observed["arrivalRate"] == 0.4
    # 0.02 req/s more every 30 s, over the default pod start (600 s) on the planning rate
    assert observed["forecastRate"] == pytest.approx(0.4 + 0.02 / 30.0 * 600.0, rel=0.05)


def test_a_rate_that_swings_between_windows_reaches_the_plan_as_its_variation() -> None:
    """Regression (issue 39, the Mooncake-shaped surge): the decode KV cliff read only the mean
    rate, so a load whose rate swings by half from one window to the next was planned for its
    mean. The loop measures the swing from its tick rates (`signals.rate_variation`), shows it
    (`status.autoscaler.observed.rateVariation`) and hands it to the planner's workload
    (`planner_workload`: `WorkloadInputs.rate_cv`), which `model.kv_overflow` reads."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    for i in range(24):  # 0.3 and 0.6 req/s in turn, a window each (the default 300 s)
        for name in ("a-d0", "a-d1"):
            count = 45.0 if (i // 10) % 2 == 0 else 90.0
            source.by_name[name] = replace(HEALTHY, requests=count, token_usage=0.4)
        g.tick([res], now=T0 + 30.0 * i)
    shown = sections(g, "a")["autoscaler"]["observed"]["rateVariation"]
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.rate_cv == shown
    assert shown > 0.1  # (a steady rise reads 0: the test above)
    declared = WorkloadSpec.model_validate(AUTO["workload"])
    assert planner_workload(declared, 0.6, planned).rate_cv == shown


def test_auto_plans_without_the_hit_rate_of_a_prefill_pool_it_changed_minutes_ago() -> None:
    """Regression (issue 18, planner benchmark's rebalance): minutes after Auto cut prefill
    21 -> 17 the moved sessions re-prefilled their contexts, the measured hit rate dipped to
    0.85 against a steady 0.93, the planner rescaled its model by it and planned 26P:2D for 4x
    answers. Until `HIT_SETTLE_S` after Auto's last prefill change the plan's load carries no
    hit rate (status shows the measured one, and until when it is held); after it, it is planned."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    changed = {"prefill": 1, "decode": 2, "lastPrefillChange": T0 - 60.0}
    res = resource("a", status={"autoscaler": changed}) | {"spec": AUTO}
    g.tick([res], now=T0)
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.hit_rate is None
    entry = sections(g, "a")["autoscaler"]
    assert entry["observed"]["hitRate"] == 0.8  # status still shows what was measured
    assert entry["hitRateHeldUntil"] == rfc3339(T0 - 60.0 + HIT_SETTLE_S)
    settled, _ = guard(store, source)
    changed["lastPrefillChange"] = T0 - HIT_SETTLE_S
    settled.tick([resource("a", status={"autoscaler": changed}) | {"spec": AUTO}], now=T0)
    planned = settled.measured["uid-a"].observed
    assert planned is not None and planned.hit_rate == 0.8
    assert "hitRateHeldUntil" not in sections(settled, "a")["autoscaler"]


def test_a_prefill_pod_ready_minutes_ago_also_holds_back_the_hit_rate() -> None:
    """A new pool, a grown one or a replaced pod starts with a cold cache: the planner
    benchmark's long tool pauses planned 30P:2D from the first minutes' 0.88 (0.93 later),
    before Auto had changed anything. A prefill pod Ready less than `HIT_SETTLE_S` ago holds
    the hit rate back like Auto's own change, in Recommend too; one Ready long before does
    not."""
    store, source = pd_fleet()
    ready = store.pod("a-p0")["status"]["conditions"][0]
    ready["lastTransitionTime"] = rfc3339(T0 - 120.0)
    g, _ = guard(store, source)
    g.tick([resource("a") | {"spec": AUTO}], now=T0)
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.hit_rate is None
    recommend = {**AUTO, "ratio": {"mode": "Recommend"}}  # what it recommends is planned so too
    advised, _ = guard(store, source)
    advised.tick([resource("a") | {"spec": recommend}], now=T0)
    planned = advised.measured["uid-a"].observed
    assert planned is not None and planned.hit_rate is None
    assert "hitRateHeldUntil" in sections(advised, "a")["autoscaler"]
    settled, _ = guard(store, source)
    settled.tick([resource("a") | {"spec": AUTO}], now=T0 + HIT_SETTLE_S)
    planned = settled.measured["uid-a"].observed
    assert planned is not None and planned.hit_rate == 0.8


def test_the_planners_last_split_reaches_its_next_plan_and_survives_a_restart() -> None:
    """Regression (issue 39, bench.planner_traces' steady middle load on real sessions): each
    plan at the GPU cap was made afresh, so Auto followed its inputs' noise between
    neighbouring splits. The planner's counts are kept in `status.autoscaler.planned`, and the
    next plan reads them (`ObservedSignals.planned_before`), keeping that split unless another
    scores clearly more (`search._kept_split`); a restarted operator reads them from status."""
    store, source = pd_fleet()
    g, _ = guard(store, source)
    res = resource("a")
    res["spec"] = AUTO
    g.tick([res], now=T0)
    first = g.measured["uid-a"].observed
    assert first is not None and first.planned_before is None  # nothing planned before
    planned = sections(g, "a")["autoscaler"]["planned"]
    assert planned["prefill"] > 0 and planned["decode"] > 0
    g.tick([res], now=T0 + 30.0)
    second = g.measured["uid-a"].observed
    assert second is not None
    assert second.planned_before == (planned["prefill"], planned["decode"])
    kept = {"autoscaler": {"prefill": 3, "decode": 2, "planned": {"prefill": 5, "decode": 3}}}
    restarted, _ = guard(*pd_fleet())
    restarted.tick([resource("a", status=kept) | {"spec": AUTO}], now=T0)
    after = restarted.measured["uid-a"].observed
    assert after is not None and after.planned_before == (5, 3)


def test_a_fleet_short_of_its_plan_is_planned_for_the_rate_it_had_at_its_plan() -> None:
    """Regression (issue 39, real sessions' Mooncake-shaped surge): while a move's pods
    started, arrivals fell (a short fleet answers slower, and agent sessions wait for their
    answers) and the planner reversed the move before its pods were Ready. The loop reads
    short from the pools' desired and Ready counts (status.prefill / status.decode) and
    holds the rate it sized for at the plan (`status.autoscaler.observed.demandRate`)."""
    store, source = pd_fleet()
    g, _ = guard(store, source)

    def fleet(decode_ready: int) -> Any:
        pools = {
            "prefill": {"replicas": 1, "readyReplicas": 1},
            "decode": {"replicas": 3, "readyReplicas": decode_ready},
        }
        return resource("a", status=pools) | {"spec": AUTO}

    g.tick([fleet(3)], now=T0)  # at its plan: 0.4 req/s
    for name in ("a-d0", "a-d1"):  # arrivals halve while a decode pod starts
        source.by_name[name] = replace(HEALTHY, requests=30.0, token_usage=0.4)
    g.tick([fleet(2)], now=T0 + 30.0)
    observed = sections(g, "a")["autoscaler"]["observed"]
    assert observed["arrivalRate"] == 0.2 and observed["demandRate"] == 0.4
    planned = g.measured["uid-a"].observed
    assert planned is not None and planned.demand_rate == 0.4
    g.tick([fleet(3)], now=T0 + 60.0)  # the pod is Ready: the measured rate counts again
    assert "demandRate" not in sections(g, "a")["autoscaler"]["observed"]

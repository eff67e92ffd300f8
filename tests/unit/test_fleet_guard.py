"""The fleet-wide anomaly loop: one pod LIST per namespace per tick, one guard_tick per
resource over that snapshot, status written only when it changed, failures isolated.

The seams are a pod store with the `Kube` calls the loop uses and a canned metrics source;
the real API server runs it in e2e/tests (the operator process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cas_operator.api import constants as c
from cas_operator.drain import ANNOTATION_DRAINING_SINCE
from cas_operator.fleet_guard import RESYNC_SECONDS, FleetGuard, PodSnapshot
from cas_operator.observe.types import Observation, PodTarget
from cas_operator.planning.anomaly import PodSignals

HEALTHY = PodSignals(checked=2000, trips_low_accept=0, trips_high_accept=1, running=3)
CORRUPT = PodSignals(checked=2000, trips_low_accept=80, trips_high_accept=0, running=4)
T0 = 1_800_000_000.0


def pod(owner: str, namespace: str, name: str, role: str = "decode") -> dict[str, Any]:
    labels = {c.LABEL_NAME: owner, c.LABEL_APP_NAME: c.APP_ENGINE, c.LABEL_ROLE: role,
              c.LABEL_SERVING: "true"}  # fmt: skip
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


class PodStore:
    """Pods keyed by (namespace, name); counts LISTs; records status patches."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.lists: list[str] = []
        self.status_patches: list[tuple[str, dict[str, Any]]] = []
        self.fail_status_for: set[str] = set()

    def list_labelled(
        self, kind: str, namespace: str, label: str, keep: Any = lambda p: p
    ) -> list[dict[str, Any]]:
        self.lists.append(namespace)
        return [keep(p) for (ns, _), p in self.pods.items()
                if ns == namespace and label in p["metadata"]["labels"]]  # fmt: skip

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        raise AssertionError("the loop must read pods from its snapshot, not list per resource")

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> Any:
        meta = self.pods[(namespace, name)]["metadata"]
        for key, value in patch["metadata"].get("labels", {}).items():
            if value is None:
                meta["labels"].pop(key, None)
        meta["annotations"].update(patch["metadata"].get("annotations", {}))
        return self.pods[(namespace, name)]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.pods.pop((namespace, name), None)

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> Any:
        if name in self.fail_status_for:
            raise RuntimeError("API server said no")
        self.status_patches.append((name, status))
        return {}


class Canned:
    def __init__(self) -> None:
        self.by_name: dict[str, PodSignals] = {}
        self.calls: list[tuple[float, list[str]]] = []
        self.error: str | None = None

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation:
        self.calls.append((window_seconds, sorted(t.name for t in targets)))
        if self.error is not None:
            return Observation.outage(targets, self.error)
        return Observation({t.name: self.by_name.get(t.name, HEALTHY) for t in targets})


class NoRouters:
    def deregister(self, worker_url: str) -> list[str]:
        return []


def guard(store: PodStore, source: Canned) -> tuple[FleetGuard, list[tuple[str, Any]]]:
    posted: list[tuple[str, Any]] = []
    g = FleetGuard(
        store,  # type: ignore[arg-type]
        lambda: source,
        lambda body, event: posted.append((body["metadata"]["name"], event)),
    )
    return g, posted


def fleets() -> PodStore:
    pods = [pod(owner, ns, f"{owner}-d{i}") for owner, ns in (("a", "ns"), ("b", "ns"),
            ("c", "other")) for i in range(5)]  # fmt: skip
    return PodStore(pods)


def test_one_pod_list_per_namespace_for_any_number_of_resources() -> None:
    """Regression: a kopf timer per resource listed pods per resource (20 LISTs/s at N=200)."""
    store, source = fleets(), Canned()
    g, _ = guard(store, source)
    g.tick([resource("a"), resource("b"), resource("c", "other")], now=T0)
    assert sorted(store.lists) == ["ns", "other"]


def test_the_metrics_source_is_asked_once_per_tick_and_window() -> None:
    """Regression: each resource queried Prometheus itself (12 PromQL queries per resource per
    tick: ~2,400 per tick at N=200). One batched observation per window serves every resource,
    each reading only its own pods."""
    store, source = fleets(), Canned()
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
    store, source = fleets(), Canned()
    source.error = "prometheus unavailable: refused"
    g, _ = guard(store, source)
    g.tick([resource("a"), resource("b")], now=T0)
    assert all(p[1]["anomaly"]["signalUnavailable"] for p in store.status_patches)


def test_status_is_written_only_when_it_changed() -> None:
    """Regression: an unchanged anomaly status must not be patched every 10 s per resource."""
    store, source = fleets(), Canned()
    g, _ = guard(store, source)
    resources = [resource("a"), resource("b")]
    assert g.tick(resources, now=T0) == 2
    written = dict(store.status_patches)
    assert written["a"]["anomaly"]["fleetWide"] is None and written["a"]["draining"] == []
    unchanged = [resource(r, status=written[r]) for r in ("a", "b")]
    store.status_patches.clear()
    assert g.tick(unchanged, now=T0 + 10) == 0 and store.status_patches == []


def test_a_lagging_status_copy_does_not_rewrite_the_same_status() -> None:
    """Regression (bench-operator N=200: 12.8 guard status writes per resource in 13 ticks):
    the resource copy the guard reads lags its own writes under load; the guard diffs against
    what it wrote, and against the object again after RESYNC_SECONDS (repairs foreign edits)."""
    store, source = fleets(), Canned()
    g, _ = guard(store, source)
    stale = [resource("a")]  # the watch has not delivered our write yet
    assert g.tick(stale, now=T0) == 1
    assert g.tick(stale, now=T0 + 5) == 0 and g.tick(stale, now=T0 + 10) == 0
    for written in g.written.values():
        written.at -= RESYNC_SECONDS + 1
    assert g.tick(stale, now=T0 + 15) == 1  # still not there after a resync period: rewrite


def test_a_corrupted_pod_is_drained_only_in_its_own_resource() -> None:
    """The per-resource decision still holds inside one shared snapshot: b's bad pod is
    drained after the hysteresis ticks; a's pods (same namespace) are untouched."""
    store, source = fleets(), Canned()
    source.by_name["b-d3"] = CORRUPT
    g, posted = guard(store, source)
    for t in (0, 5):
        g.tick([resource("a"), resource("b")], now=T0 + t)
    drained = {n for (_, n), p in store.pods.items()
               if ANNOTATION_DRAINING_SINCE in p["metadata"]["annotations"]}  # fmt: skip
    assert drained == {"b-d3"}
    assert ("b", ("Warning", "PodDraining", "pod b-d3 out of rotation: low_accept_length")) in [
        (name, e) for name, e in posted
    ]
    assert dict(store.status_patches)["b"]["draining"][0]["pod"] == "b-d3"


def test_a_failing_event_post_does_not_cost_the_status_write() -> None:
    """Regression: kopf.event raised outside kopf's handlers (no event queue) before the status
    patch, so every tick with events (a drain start, a deletion) wrote no status."""
    store, source = fleets(), Canned()
    source.by_name["b-d3"] = CORRUPT

    def refuse(body: Any, event: Any) -> None:
        raise LookupError("no event queue here")

    g = FleetGuard(store, lambda: source, refuse)  # type: ignore[arg-type]
    for t in (0, 5):
        g.tick([resource("b")], now=T0 + t)
    assert [d["pod"] for d in store.status_patches[-1][1]["draining"]] == ["b-d3"]


def test_one_failing_resource_does_not_stop_the_others() -> None:
    """Regression guard: an exception in one resource's tick is logged, the rest proceed."""
    store, source = fleets(), Canned()
    store.fail_status_for = {"a"}
    g, _ = guard(store, source)
    assert g.tick([resource("a"), resource("b")], now=T0) == 1
    assert [name for name, _ in store.status_patches] == ["b"]


def test_a_changed_anomaly_asks_for_a_pass_with_the_finding_in_memory() -> None:
    """Regression: conditions fold status.anomaly in; a pass reading the event's stale copy
    kept Degraded/FleetWideAnomaly wrong until the 30 s timer. The loop now hands its finding
    over in memory and asks for a pass when it changed (and not when it did not)."""
    store, source = fleets(), Canned()
    changed: list[str] = []
    g, _ = guard(store, source)
    g.on_change = lambda r: changed.append(r["metadata"]["name"])
    g.tick([resource("a")], now=T0)
    assert changed == ["a"]
    assert g.measured_for("uid-a", {}).anomaly == dict(store.status_patches)["a"]["anomaly"]
    g.tick([resource("a", status=dict(store.status_patches)["a"])], now=T0 + 10)
    assert changed == ["a"]


def test_state_of_deleted_resources_is_forgotten() -> None:
    store, source = fleets(), Canned()
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


AUTO = {"model": {"name": "glm-5"}, "ratio": {"mode": "Auto", "gpuBudget": 64},
        "workload": {"requestRate": 2.0}}  # fmt: skip


def pd_fleet() -> tuple[PodStore, Canned]:
    pods = [pod("a", "ns", "a-p0", "prefill"), pod("a", "ns", "a-d0"), pod("a", "ns", "a-d1")]
    source = Canned()
    source.by_name["a-p0"] = PodSignals(prompt_tokens=1000.0, cached_tokens=800.0, queued=0.0)
    for name in ("a-d0", "a-d1"):
        source.by_name[name] = replace(HEALTHY, requests=60.0, token_usage=0.4)
    return PodStore(pods), source


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
    entry = dict(store.status_patches)["a"]["autoscaler"]
    assert entry["observed"]["arrivalRate"] == 120.0 / 300.0  # two decodes over the 300 s window
    assert entry["observed"]["hitRate"] == 0.8
    assert (entry["prefill"], entry["decode"]) == g.measured_for("uid-a", {}).auto_replicas
    assert changed == ["a"]


def test_auto_replicas_survive_an_operator_restart_through_status() -> None:
    g, _ = guard(*pd_fleet())
    kept = {"autoscaler": {"prefill": 3, "decode": 2, "reason": "earlier"}}
    assert g.measured_for("uid-a", kept).auto_replicas == (3, 2)


def test_fixed_mode_writes_no_autoscaler_status() -> None:
    store, source = pd_fleet()
    g, _ = guard(store, source)
    g.tick([resource("a")], now=T0)
    assert "autoscaler" not in dict(store.status_patches)["a"]
    kept = g.measured["uid-a"]
    assert kept.observed is None and kept.auto_replicas is None and kept.anomaly is not None


def test_pods_are_listed_in_pages_and_slimmed_as_they_arrive() -> None:
    """Regression guard for the operator's memory at N=200: the fleet LIST is paged and each
    pod keeps only what the loop reads (no spec, no managedFields)."""
    from cas_operator.fleet_guard import slim_pod
    from cas_operator.kube import Kube

    pages = {"": (["a", "b"], "t1"), "t1": (["c"], "")}
    asked: list[list[tuple[str, str]]] = []

    def fake_call(method: str, path: str, *, query: list[tuple[str, str]]) -> Any:
        asked.append(query)
        names, token = pages[dict(query).get("continue", "")]
        items = [{**pod("x", "ns", n), "spec": {"containers": [{"args": ["--big"] * 100}]}}
                 for n in names]  # fmt: skip
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

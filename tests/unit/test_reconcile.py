"""The reconcile pass over an in-memory API seam (the real API server is in e2e/tests)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from cas_operator.api import constants as c
from cas_operator.kube import KindNotInstalled, Kube, NamespaceTerminating
from cas_operator.reconcile.core import Measured, observe, reconcile
from cas_operator.reconcile.status import find_condition
from cas_operator.scaledown.decide import PoolFloor, RevisionLoad
from cas_operator.types import rfc3339
from tests.fakes import MemoryKube


def run(
    kube: MemoryKube, spec: dict[str, Any], *, full: bool = True, generation: int = 1, **extra: Any
) -> Any:
    """One pass of resource ns/demo against `kube` (`extra`: reconcile's other arguments)."""
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid="uid-1",
        generation=generation,
        raw_spec=spec,
        full_apply=full,
        **extra,
    )


SPEC = {"model": {"name": "glm-5"}}


def ready_of(outcome: Any) -> str:
    return str(find_condition(outcome.status, c.COND_READY)["status"])


def test_first_pass_applies_everything_and_reports_ready() -> None:
    kube = MemoryKube()
    outcome = run(kube, SPEC)
    kinds = [kind for kind, _ in kube.applies]
    assert kinds.count("Deployment") == 3 and "Service" in kinds and "PodDisruptionBudget" in kinds
    assert ready_of(outcome) == "True" and outcome.invalid is None


def test_timer_pass_skips_unchanged_children() -> None:
    """Regression: re-applying every child on every timer tick costs N API writes per tick."""
    kube = MemoryKube()
    run(kube, SPEC)
    kube.applies.clear()
    outcome = run(kube, SPEC, full=False)
    assert kube.applies == [] and outcome.applied == 0


def test_timer_pass_reapplies_a_drifted_workload() -> None:
    kube = MemoryKube()
    run(kube, SPEC)
    key = next(k for k in kube.objects if k[0] == "Deployment")
    kube.objects[key]["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH] = "tampered"
    kube.applies.clear()
    run(kube, SPEC, full=False)
    assert kube.applies == [key]


def test_a_pool_scaled_down_by_hand_is_scaled_back_by_the_next_refresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`kubectl scale` leaves our spec-hash annotation alone; the replicas tell. The log states
    what differs (our own Auto step lagging in the watch looks the same, so it blames no one)."""
    kube = MemoryKube()
    run(kube, SPEC)
    key = next(k for k in kube.objects if k[0] == "Deployment" and "router" not in k[1])
    kube.objects[key]["spec"]["replicas"] = 0
    kube.applies.clear()
    with caplog.at_level("INFO", logger="cas_operator.reconcile"):
        run(kube, SPEC, full=False)
    assert kube.applies == [key] and kube.objects[key]["spec"]["replicas"] == 1
    assert f"re-applying Deployment {key[1]}: replicas differ (0 observed, 1 desired)" in (
        caplog.text
    )


def test_a_pool_above_its_count_shrinks_only_as_far_as_instances_are_released() -> None:
    """Regression (issue 15): lowering replicas let the ReplicaSet pick a busy pod; now a pool
    shrinks only by the instances the scale-down loop released (`Measured.floors`)."""
    kube = MemoryKube()
    run(kube, SPEC)
    key = next(k for k in kube.objects if k[0] == "Deployment" and "prefill" in k[1])
    revision = kube.objects[key]["metadata"]["labels"][c.LABEL_REVISION]
    kube.objects[key]["spec"]["replicas"] = 4
    for full in (False, True):
        run(kube, SPEC, full=full)
        assert kube.objects[key]["spec"]["replicas"] == 4  # nothing released: nothing cut
    floor = PoolFloor(revision, c.ROLE_PREFILL, keep=3, live=4)
    run(kube, SPEC, full=False, measured=Measured(floors=(floor,)))
    assert kube.objects[key]["spec"]["replicas"] == 3
    run(kube, SPEC, full=False, measured=Measured(floors=(replace(floor, keep=0),)))
    assert kube.objects[key]["spec"]["replicas"] == 1  # never below the desired count


def test_invalid_spec_reports_field_and_applies_nothing() -> None:
    kube = MemoryKube()
    outcome = run(kube, {"model": {"name": "glm-5"}, "prefill": {"tensorParallel": 0}})
    assert outcome.invalid is not None and "prefill.tensorParallel" in str(outcome.invalid)
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded["reason"] == c.REASON_INVALID_SPEC and degraded["status"] == "True"
    assert kube.applies == []


def test_missing_lws_api_is_degraded_not_a_crash() -> None:
    """Regression: a multi-node pool on a cluster without LWS must say so in a condition."""
    kube = MemoryKube(lws=False)
    outcome = run(kube, {"model": {"name": "glm-5"}, "decode": {"tensorParallel": 16}})
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded["status"] == "True" and degraded["reason"] == c.REASON_LWS_MISSING
    assert ("Deployment", next(n for k, n in kube.applies if k == "Deployment")) in kube.applies


T0 = 1_800_000_000.0
V2 = {**SPEC, "engine": {"image": "engine:v2"}}


def entry_selector(kube: MemoryKube) -> dict[str, str]:
    selector: dict[str, str] = kube.objects[("Service", "demo")]["spec"]["selector"]
    return selector


def test_an_older_revision_serves_and_stays_until_the_new_one_is_ready() -> None:
    """Regression: deleting the old pools before the new ones serve drops traffic; and the
    entry Service spanned both routers, sending users to a router whose engines were not up."""
    kube = MemoryKube()
    old = run(kube, SPEC).status["revision"]
    before = {k for k in kube.objects if k[0] == "Deployment"}
    kube.ready = False
    outcome = run(kube, V2, generation=2, previous={"servingRevision": old})
    assert before <= set(kube.objects) and not kube.deleted
    assert find_condition(outcome.status, c.COND_PROGRESSING)["reason"] == c.REASON_ROLLING
    assert entry_selector(kube)[c.LABEL_REVISION] == old
    assert outcome.status["servingRevision"] == old


def test_an_older_revision_leaves_the_entry_point_first_and_goes_once_idle() -> None:
    """Regression (issue 15): retiring deleted the old router and engines at once, cutting
    the requests they ran. Now: entry Service to the new revision alone, the old router
    marked, its children deleted only once the fleet tick reads its engines idle."""
    kube = MemoryKube()
    old = run(kube, SPEC).status["revision"]
    previous = {"servingRevision": old}
    first = run(kube, V2, generation=2, previous=previous, now=T0)
    new = first.status["revision"]
    assert entry_selector(kube)[c.LABEL_REVISION] == new and not kube.deleted
    for role in ("router", "prefill", "decode"):
        marked = kube.objects[("Deployment", f"demo-{role}-{old}")]["metadata"]["annotations"]
        assert marked[c.ANNOTATION_RETIRING_SINCE] == rfc3339(T0)
    progressing = find_condition(first.status, c.COND_PROGRESSING)["message"]
    assert f"retiring {old}: out of the entry point" in progressing
    previous = first.status

    def at(seconds: float, work: float | None) -> Any:
        measured = Measured(older=(RevisionLoad(old, work),))
        return run(kube, V2, full=False, generation=2, previous=previous, measured=measured,
                   now=T0 + seconds)  # fmt: skip

    at(5, 0.0)  # a reading from before the entry moved may say idle
    assert not kube.deleted
    busy = at(20, 3.0)  # kube-proxy has dropped the old router: it drains (SIGTERM)
    assert kube.deleted == [("Deployment", f"demo-router-{old}")]
    assert [e[1] for e in busy.events] == ["RouterRetired"]
    assert "3 requests in flight" in find_condition(busy.status, c.COND_PROGRESSING)["message"]
    done = at(25, 0.0)
    assert {k for k in kube.objects if old in k[1]} == set()
    assert {k for k in kube.deleted if k[0] == "Service"}  # pool Services went too
    assert [e[1] for e in done.events] == ["RevisionRetired"]
    assert find_condition(done.status, c.COND_PROGRESSING)["status"] == "False"


def test_an_idle_older_revision_loses_its_router_first_and_its_engines_after_its_pods() -> None:
    """Regression (issue 41, seen in e2e/tests/test_keys_rotation.py): engines idle when the
    wait was over took the old router and its engines down at once; the router, in its preStop
    sleep, still took requests on its clients' kept-alive connections and, its prefill gone,
    answered them 503. The engines now go only once the router's pods are gone."""
    kube = MemoryKube()
    old = run(kube, SPEC).status["revision"]
    first = run(kube, V2, generation=2, previous={"servingRevision": old}, now=T0)
    kwargs = {"generation": 2, "previous": first.status, "full": False}
    idle = Measured(older=(RevisionLoad(old, 0.0),))
    pod = {"kind": "Pod", "metadata": {"name": f"demo-router-{old}-x", "labels": {
        c.LABEL_NAME: "demo", c.LABEL_ROLE: c.ROLE_ROUTER, c.LABEL_REVISION: old}}}  # fmt: skip
    kube.objects[("Pod", pod["metadata"]["name"])] = pod
    first_retire = run(kube, V2, now=T0 + 20, measured=idle, **kwargs)
    assert kube.deleted == [("Deployment", f"demo-router-{old}")]  # the router alone
    assert "its routers finish first" in find_condition(
        first_retire.status, c.COND_PROGRESSING)["message"]  # fmt: skip
    run(kube, V2, now=T0 + 25, measured=idle, **kwargs)  # its pod still terminating
    assert {k for k in kube.objects if old in k[1] and k[0] == "Deployment"} == {
        ("Deployment", f"demo-prefill-{old}"), ("Deployment", f"demo-decode-{old}")}  # fmt: skip
    del kube.objects[("Pod", pod["metadata"]["name"])]
    run(kube, V2, now=T0 + 30, measured=idle, **kwargs)
    assert {k for k in kube.objects if old in k[1] and k[0] != "Pod"} == set()


def test_an_older_revision_whose_work_is_unknown_goes_after_the_drain_grace() -> None:
    kube = MemoryKube()
    old = run(kube, SPEC).status["revision"]
    first = run(kube, V2, generation=2, previous={"servingRevision": old}, now=T0)
    measured = Measured(older=(RevisionLoad(old, None),))
    kwargs = {"generation": 2, "previous": first.status, "measured": measured, "full": False}
    run(kube, V2, now=T0 + 599, **kwargs)
    assert kube.deleted == [("Deployment", f"demo-router-{old}")]  # only the router drains
    run(kube, V2, now=T0 + 600, **kwargs)  # engine.drainSeconds: their preStop holds the rest
    assert {k for k in kube.objects if old in k[1]} == set()


def watched(kube: MemoryKube, *, full: bool, observed: list[Any], apply_missing: bool) -> Any:
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid="uid-1",
        generation=1,
        raw_spec=SPEC,
        full_apply=full,
        observed=observed,
        apply_missing=apply_missing,
    )


def test_a_watched_pass_takes_workloads_from_the_apply_answers_not_a_list() -> None:
    """Regression (bench-operator N=200: 3.5 LISTs per resource): with the caller's watch-fed
    copy, a full pass builds its status from the server's apply answers."""
    kube = MemoryKube()
    outcome = watched(kube, full=True, observed=[], apply_missing=True)
    assert kube.lists == 0 and ready_of(outcome) == "True"


def test_a_workload_the_watch_has_not_delivered_yet_is_not_reapplied() -> None:
    """Regression (bench-operator N=200: 10 Deployment applies per resource, 3 Deployments):
    a child event right after the create found the other Deployments not yet indexed and
    re-applied them. Missing ones are applied only when the caller allows it (deleted)."""
    kube = MemoryKube()
    run(kube, SPEC)
    everything = observe(kube, "ns", "demo")  # type: ignore[arg-type]
    partial = [w for w in everything if w.role == c.ROLE_PREFILL]
    kube.applies.clear()
    watched(kube, full=False, observed=partial, apply_missing=False)
    assert kube.applies == []
    watched(kube, full=False, observed=partial, apply_missing=True)
    assert sorted(name for _, name in kube.applies) == sorted(
        w.name for w in everything if w.role != c.ROLE_PREFILL
    )
    drifted = [replace(w, spec_hash="old") if w.role == c.ROLE_PREFILL else w for w in everything]
    kube.applies.clear()
    watched(kube, full=False, observed=drifted, apply_missing=False)
    assert [name for _, name in kube.applies] == [partial[0].name]  # drift is always repaired


def test_a_namespace_being_deleted_is_not_reported_as_a_failed_apply() -> None:
    """Seen at bench-operator N=200: resources of a namespace being deleted were resumed and
    every apply answered 403 'being terminated'; that is not a fault to show as Degraded."""

    class Terminating(MemoryKube):
        def apply(self, manifest: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
            raise NamespaceTerminating("ns")

    class Refused(MemoryKube):
        def apply(self, manifest: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
            raise ApiException(status=403, reason="Forbidden", body="RBAC says no")

    terminating, refused = run(Terminating(), SPEC), run(Refused(), SPEC)
    assert find_condition(terminating.status, c.COND_DEGRADED)["status"] == "False"
    assert terminating.failed == 0  # nothing to retry
    degraded = find_condition(refused.status, c.COND_DEGRADED)
    assert degraded["status"] == "True" and degraded["reason"] == c.REASON_APPLY_FAILED
    assert refused.failed > 0  # the spec handler retries it (handlers.APPLY_RETRY_FIRST_S)


def test_kube_tells_a_terminating_namespace_from_other_refusals() -> None:
    """The API client (the only module that knows HTTP statuses) turns the API server's 403
    'being terminated' into NamespaceTerminating, and leaves any other 403 an ApiException."""
    body = json.dumps(
        {"message": "unable to create new content in namespace ns because it is being terminated"}
    )
    kube = Kube.__new__(Kube)
    manifest = {"kind": "Service", "metadata": {"name": "x", "namespace": "ns"}}
    for answer, expected in ((body, NamespaceTerminating), ("RBAC says no", ApiException)):

        def refuse(*_: Any, answer: str = answer, **__: Any) -> Any:
            raise ApiException(status=403, reason="Forbidden", body=answer)

        kube._call = refuse  # type: ignore[method-assign]
        with pytest.raises(expected):
            kube.apply(manifest)


def test_a_404_naming_an_object_is_a_failed_apply_not_a_missing_kind() -> None:
    """Regression (issue 17, operator under the chart's token): a RoleBinding applied before
    its Role existed got 404 'rolebindings "x" not found' from the escalation check, and the
    operator reported it as the LeaderWorkerSet API missing. Only a 404 that names no object
    means the kind is not served."""
    kube = Kube.__new__(Kube)
    manifest = {"kind": "RoleBinding", "metadata": {"name": "x", "namespace": "ns"}}
    named = {"reason": "NotFound", "details": {"name": "x", "kind": "rolebindings"}, "code": 404}
    unserved = {"message": "the server could not find the requested resource", "details": {}}
    for body, expected in ((named, ApiException), (unserved, KindNotInstalled)):

        def refuse(*_: Any, answer: str = json.dumps(body), **__: Any) -> Any:
            raise ApiException(status=404, reason="Not Found", body=answer)

        kube._call = refuse  # type: ignore[method-assign]
        with pytest.raises(expected):
            kube.apply(manifest)


def test_a_fleet_wide_finding_and_its_condition_come_in_one_status() -> None:
    """Regression (make test on a fresh machine: `Degraded` said FleetWideAnomaly while
    `status.anomaly` had no fleetWide, because the fleet tick and the passes wrote them in
    separate patches). The pass now returns the fleet tick's sections with the conditions
    derived from them, so one status write carries both, or neither."""
    anomaly = {
        "rate": "2.000%",
        "pools": {},
        "fleetWide": "most decode pods elevated",
        "signalUnavailable": None,
    }
    measured = Measured(sections={"anomaly": anomaly, "draining": []})
    outcome = reconcile(
        MemoryKube(),
        name="demo",
        namespace="ns",
        uid="u1",
        generation=1,
        raw_spec=SPEC,
        full_apply=True,
        measured=measured,
    )
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded is not None and degraded["reason"] == c.REASON_FLEET_ANOMALY
    assert outcome.status["anomaly"]["fleetWide"] == "most decode pods elevated"
    assert outcome.status["draining"] == []


def test_kube_evicts_through_the_eviction_api_with_the_pods_uid() -> None:
    """Drains and replacements POST an Eviction (PodDisruptionBudgets hold) with the pod's uid
    as a precondition (LWS leader pods keep their names: a DELETE by name could hit the new
    pod). A budget's refusal (429) is "not now"; a missing pod or another uid is done."""
    sent: list[tuple[str, str, Any]] = []
    answers = iter([None, ApiException(status=429), ApiException(status=409),
                    ApiException(status=500)])  # fmt: skip

    def call(method: str, path: str, *, body: Any = None, **_: Any) -> Any:
        sent.append((method, path, body))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    kube = Kube.__new__(Kube)
    kube._call = call  # type: ignore[method-assign,assignment]
    assert kube.evict("ns", "d0", "uid-1") is True
    method, path, body = sent[0]
    assert (method, path) == ("POST", "/api/v1/namespaces/ns/pods/d0/eviction")
    assert body["kind"] == "Eviction" and body["deleteOptions"]["preconditions"] == {"uid": "uid-1"}
    assert kube.evict("ns", "d0", "uid-1") is False
    assert kube.evict("ns", "d0", "uid-1") is True
    with pytest.raises(ApiException):
        kube.evict("ns", "d0", "uid-1")

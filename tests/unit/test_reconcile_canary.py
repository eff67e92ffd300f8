"""A Canary fleet's reconcile over the in-memory API seam: what a pass applies for each
rollout state (the real API server, Gateway and routers are in e2e/tests/test_canary.py).

Regressions guarded: a Canary spec change rolled like Rolling (the new revision at full size,
the entry moved to it once Ready, the old one retired); nothing split traffic by weight; the
Argo CD health check could not tell a paused or aborted rollout from a healthy fleet.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cas_operator.api import constants as c
from cas_operator.reconcile.core import Measured, reconcile
from cas_operator.reconcile.status import find_condition
from cas_operator.rollout.state import Phase, RolloutState
from cas_operator.scaledown.decide import RevisionLoad
from tests.fakes import MemoryKube
from tests.unit.test_argocd_health import health

GATEWAY = {"parentRefs": [{"name": "gw", "namespace": "default"}]}
V1: dict[str, Any] = {
    "model": {"name": "glm-5"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 4},
    "rollout": {"strategy": "Canary", "steps": [{"weight": 10}, {"weight": 50}]},
    "gateway": GATEWAY,
}
V2 = {**V1, "engine": {"image": "cas-engine:v2"}}
NOW = 1_790_000_000.0


def run(kube: MemoryKube, spec: dict[str, Any], generation: int = 1, **extra: Any) -> Any:
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid="uid-1",
        generation=generation,
        raw_spec=spec,
        full_apply=extra.pop("full", True),
        now=extra.pop("now", NOW),
        **extra,
    )


def as_resource(outcome: Any, generation: int) -> dict[str, Any]:
    """The resource as Argo CD would read it after this pass's status write."""
    return {"metadata": {"generation": generation}, "status": outcome.status}


def replicas(kube: MemoryKube, name: str) -> int:
    return int(kube.objects[("Deployment", name)]["spec"]["replicas"])


def weights(kube: MemoryKube) -> list[int]:
    route = kube.objects[("HTTPRoute", "demo")]
    return [ref["weight"] for ref in route["spec"]["rules"][0]["backendRefs"]]


def gateway_reads_the_route(kube: MemoryKube) -> None:
    """What the Gateway's controller does with the route: report that it read its current
    generation."""
    route = kube.objects[("HTTPRoute", "demo")]
    read = {"type": "Accepted", "observedGeneration": route["metadata"]["generation"]}
    route["status"] = {"parents": [{"conditions": [read]}]}


def selector(kube: MemoryKube, service: str) -> dict[str, str]:
    return dict(kube.objects[("Service", service)]["spec"]["selector"])


def started(kube: MemoryKube) -> tuple[str, str, Any]:
    """V1 running, then V2 applied: (r1, r2, the second pass's outcome)."""
    first = run(kube, V1)
    second = run(kube, V2, generation=2, previous=first.status)
    return first.status["revision"], second.status["revision"], second


def test_a_new_revision_starts_as_a_small_canary_while_the_stable_one_serves() -> None:
    kube = MemoryKube()
    r1, r2, outcome = started(kube)
    assert r1 != r2
    assert (replicas(kube, f"demo-prefill-{r1}"), replicas(kube, f"demo-decode-{r1}")) == (2, 4)
    assert (replicas(kube, f"demo-prefill-{r2}"), replicas(kube, f"demo-decode-{r2}")) == (1, 1)
    assert weights(kube) == [100, 0]
    assert selector(kube, "demo-stable")[c.LABEL_REVISION] == r1
    assert selector(kube, "demo-canary")[c.LABEL_REVISION] == r2
    assert selector(kube, "demo")[c.LABEL_REVISION] == r1  # the entry Service stays stable
    rollout = outcome.status["rollout"]
    assert (rollout["phase"], rollout["stableRevision"], rollout["canaryRevision"]) == (
        "Progressing",
        r1,
        r2,
    )
    assert rollout["canary"]["readyStep"] == 0 and rollout["traffic"]["canaryWeight"] == 0
    ready = find_condition(outcome.status, c.COND_READY)
    progressing = find_condition(outcome.status, c.COND_PROGRESSING)
    assert ready is not None and ready["status"] == "True"
    assert progressing is not None and progressing["reason"] == c.REASON_CANARY
    assert health(as_resource(outcome, 2))["status"] == "Progressing"
    assert not kube.deleted


def test_the_weight_in_effect_reaches_the_httproute() -> None:
    """Regression: the route was applied only on full passes (every 5 minutes), so a step's
    weight reached the Gateway minutes late; a refresh pass must carry it."""
    kube = MemoryKube()
    r1, r2, before = started(kube)
    state = replace(RolloutState(stable=r1).adopt(r2), weight=10, step_started=NOW)
    measured = Measured(rollout=state)
    run(kube, V2, generation=2, previous=before.status, measured=measured, full=False)
    assert weights(kube) == [90, 10]
    moved = replace(state, step=1, weight=10)  # next step: pools grow first, weight stays
    outcome = run(kube, V2, generation=2, previous=before.status, measured=Measured(rollout=moved))
    assert (replicas(kube, f"demo-prefill-{r2}"), replicas(kube, f"demo-decode-{r2}")) == (1, 2)
    assert weights(kube) == [90, 10] and outcome.status["rollout"]["canary"]["readyStep"] == 1


def test_without_a_gateway_the_entry_service_spans_both_routers_at_the_weight() -> None:
    kube = MemoryKube()
    spec1 = {k: v for k, v in V1.items() if k != "gateway"}
    spec2 = {**spec1, "engine": {"image": "cas-engine:v2"}}
    first = run(kube, spec1)
    r1 = first.status["revision"]
    second = run(kube, spec2, generation=2, previous=first.status)
    r2 = second.status["revision"]
    state = replace(RolloutState(stable=r1).adopt(r2), weight=10, step_started=NOW)
    outcome = run(
        kube, spec2, generation=2, previous=second.status, measured=Measured(rollout=state)
    )
    assert c.LABEL_REVISION not in selector(kube, "demo")
    assert (replicas(kube, f"demo-router-{r1}"), replicas(kube, f"demo-router-{r2}")) == (9, 1)
    assert (
        outcome.status["rollout"]["traffic"]["precision"]
        == "1 of 10 routers (10% of new connections)"
    )
    assert ("HTTPRoute", "demo") not in kube.objects


def test_an_aborted_canary_is_retired_and_the_fleet_is_degraded() -> None:
    kube = MemoryKube()
    r1, r2, before = started(kube)
    aborted = replace(RolloutState(stable=r1).adopt(r2), weight=10).abort("gateTrips failed")
    measured = Measured(rollout=aborted, older=(RevisionLoad(r2, 0.0),))
    outcome = run(kube, V2, generation=2, previous=before.status, measured=measured)
    assert weights(kube) == [100, 0] and selector(kube, "demo-canary")[c.LABEL_REVISION] == r1
    assert kube.objects[("Deployment", f"demo-decode-{r2}")]["metadata"]["annotations"].get(
        c.ANNOTATION_RETIRING_SINCE
    )
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded is not None and degraded["reason"] == c.REASON_ROLLOUT_ABORTED
    assert health(as_resource(outcome, 2)) == {
        "status": "Degraded",
        "message": "RolloutAborted: gateTrips failed",
    }
    assert outcome.status["decode"]["summary"] == "4/4"  # the stable pools serve
    later = run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 20)
    assert kube.deleted == []  # the Gateway has not reported the weights that left them
    gateway_reads_the_route(kube)
    later = run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 20)
    assert kube.deleted == [("Deployment", f"demo-router-{r2}")]  # its router first
    later = run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 22)
    assert ("Deployment", f"demo-decode-{r2}") in kube.deleted
    assert ("Deployment", f"demo-decode-{r1}") not in kube.deleted
    assert later.events[-1][1] == "RevisionRetired"


def test_a_paused_rollout_is_suspended_in_argocd() -> None:
    kube = MemoryKube()
    r1, r2, before = started(kube)
    paused = replace(
        RolloutState(stable=r1).adopt(r2),
        weight=10,
        step_started=NOW,
        phase=Phase.PAUSED,
        reason="step 1/2: inconclusive: 3 canary requests in 60s, 50 needed",
    )
    outcome = run(kube, V2, generation=2, previous=before.status, measured=Measured(rollout=paused))
    progressing = find_condition(outcome.status, c.COND_PROGRESSING)
    assert progressing is not None and progressing["reason"] == c.REASON_ROLLOUT_PAUSED
    result = health(as_resource(outcome, 2))
    assert result["status"] == "Suspended" and "inconclusive" in result["message"]


def test_promotion_moves_both_services_and_retires_the_old_revision() -> None:
    kube = MemoryKube()
    r1, r2, before = started(kube)
    promoted = RolloutState(stable=r2)
    measured = Measured(rollout=promoted, older=(RevisionLoad(r1, 0.0),))
    outcome = run(kube, V2, generation=2, previous=before.status, measured=measured)
    assert (replicas(kube, f"demo-prefill-{r2}"), replicas(kube, f"demo-decode-{r2}")) == (2, 4)
    assert selector(kube, "demo-stable")[c.LABEL_REVISION] == r2
    assert selector(kube, "demo")[c.LABEL_REVISION] == r2 and weights(kube) == [100, 0]
    assert outcome.status["rollout"]["phase"] == "Stable"
    run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 20)
    assert kube.deleted == []  # the Gateway has not reported the weights that left them
    gateway_reads_the_route(kube)
    run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 20)
    assert kube.deleted == [("Deployment", f"demo-router-{r1}")]  # its router first
    run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 22)
    assert ("Deployment", f"demo-decode-{r1}") in kube.deleted
    final = run(kube, V2, generation=2, previous=outcome.status, measured=measured, now=NOW + 25)
    assert health(as_resource(final, 2))["status"] == "Healthy"


def test_the_users_httproute_gets_only_its_weights() -> None:
    kube = MemoryKube()
    mine = {"httpRoute": "public"}
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "public", "namespace": "ns", "resourceVersion": "7"},
        "spec": {
            "parentRefs": [{"name": "edge"}],
            "hostnames": ["code.example"],
            "rules": [
                {"matches": [{"path": {"type": "PathPrefix", "value": "/docs"}}],
                 "backendRefs": [{"name": "docs", "port": 80}]},
                {"backendRefs": [{"name": "demo-stable", "port": 80, "weight": 1},
                                 {"name": "demo-canary", "port": 80, "weight": 1}]},
            ],
        },
    }  # fmt: skip
    kube.objects[("HTTPRoute", "public")] = route
    spec1, spec2 = {**V1, "gateway": mine}, {**V2, "gateway": mine}
    first = run(kube, spec1)
    r1 = first.status["revision"]
    second = run(kube, spec2, generation=2, previous=first.status)
    state = replace(RolloutState(stable=r1).adopt(second.status["revision"]), weight=10)
    run(kube, spec2, generation=2, previous=second.status, measured=Measured(rollout=state))
    stored = kube.objects[("HTTPRoute", "public")]
    refs = stored["spec"]["rules"][1]["backendRefs"]
    assert [r["weight"] for r in refs] == [90, 10]
    assert stored["spec"]["rules"][0] == route["spec"]["rules"][0]  # type: ignore[index]
    assert stored["spec"]["hostnames"] == ["code.example"]
    assert ("HTTPRoute", "demo") not in kube.objects  # the operator owns no route here
    del stored["spec"]["rules"][1]
    broken = run(
        kube, spec2, generation=2, previous=second.status, measured=Measured(rollout=state)
    )
    degraded = find_condition(broken.status, c.COND_DEGRADED)
    assert degraded is not None and degraded["reason"] == c.REASON_INVALID_ROUTE
    assert "demo-canary and demo-stable" in degraded["message"]


def test_dropping_the_gateway_removes_the_traffic_objects_on_the_next_full_pass() -> None:
    kube = MemoryKube()
    first = run(kube, V1)
    assert ("HTTPRoute", "demo") in kube.objects
    plain = {k: v for k, v in V1.items() if k != "gateway"}
    second = run(kube, plain, generation=2, previous=first.status)
    assert ("HTTPRoute", "demo") not in kube.objects and ("Service", "demo-canary") in kube.deleted
    kube.deleted.clear()
    run(kube, plain, generation=2, previous=second.status)
    assert kube.deleted == []  # nothing recorded: no DELETE on every full pass

"""Status and conditions: Kubernetes conventions, readiness from observed children, no-op writes."""

from __future__ import annotations

from typing import Any

from cas_operator.api import constants as c
from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import Plan
from cas_operator.reconcile.status import (
    ObservedWorkload,
    Problem,
    compute_status,
    merge_conditions,
    status_patch,
    stored,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def plan_of(**spec: Any) -> Plan:
    return build_plan("demo", "ns", parse_spec({"model": {"name": "glm-5"}, **spec}))


def workload(
    plan: Plan, role: str, ready: int, replicas: int, revision: str | None = None
) -> ObservedWorkload:
    return ObservedWorkload(
        kind="Deployment",
        name=f"{role}",
        role=role,
        revision=revision or plan.revision,
        replicas=replicas,
        ready_replicas=ready,
        spec_hash=None,
        up_to_date=True,
    )


def all_ready(plan: Plan) -> list[ObservedWorkload]:
    return [
        workload(plan, c.ROLE_PREFILL, 1, 1),
        workload(plan, c.ROLE_DECODE, 1, 1),
        workload(plan, c.ROLE_ROUTER, 1, 1),
    ]


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cond["type"]: cond for cond in status["conditions"]}


def test_ready_only_when_every_pool_and_router_is_ready() -> None:
    plan = plan_of()
    status = compute_status(plan, all_ready(plan), [], generation=3)
    conds = conditions(status)
    assert conds["Ready"]["status"] == "True" and conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "False"
    assert all(cond["observedGeneration"] == 3 for cond in status["conditions"])
    assert status["prefill"]["summary"] == "1/1" and status["ratio"]["current"] == "1:1"
    partial = [workload(plan, c.ROLE_PREFILL, 0, 1), *all_ready(plan)[1:]]
    conds = conditions(compute_status(plan, partial, [], generation=3))
    assert conds["Ready"]["status"] == "False" and "prefill 0/1" in conds["Ready"]["message"]
    assert conds["Progressing"]["status"] == "True"


def test_stale_generation_is_not_ready() -> None:
    """Regression: a Deployment whose controller has not seen the new spec is not ready yet."""
    plan = plan_of()
    stale = ObservedWorkload("Deployment", "d", c.ROLE_DECODE, plan.revision, 1, 1, None, False)
    observed = [all_ready(plan)[0], stale, all_ready(plan)[2]]
    assert conditions(compute_status(plan, observed, [], 1))["Ready"]["status"] == "False"


def test_problem_makes_degraded_and_not_ready() -> None:
    plan = plan_of()
    problem = Problem(c.REASON_LWS_MISSING, "LeaderWorkerSet API is not installed")
    conds = conditions(compute_status(plan, all_ready(plan), [problem], 1))
    assert conds["Degraded"]["status"] == "True"
    assert conds["Degraded"]["reason"] == c.REASON_LWS_MISSING
    assert conds["Ready"]["status"] == "False"


def test_old_revision_shows_progressing_rollout() -> None:
    plan = plan_of()
    observed = [*all_ready(plan), workload(plan, c.ROLE_DECODE, 1, 1, revision="oldrev00")]
    conds = conditions(compute_status(plan, observed, [], 1))
    assert conds["Progressing"]["reason"] == c.REASON_ROLLING
    assert "oldrev00" in conds["Progressing"]["message"]


def test_transition_time_changes_only_on_flip() -> None:
    """Regression: rewriting lastTransitionTime every pass breaks `kubectl wait` and alerts."""
    old = [{"type": "Ready", "status": "True", "reason": "A", "lastTransitionTime": T0}]
    same = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "B"}], T1)
    assert same[0]["lastTransitionTime"] == T0 and same[0]["reason"] == "B"
    flipped = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "C"}], T1)
    assert flipped[0]["lastTransitionTime"] == T1


def test_foreign_conditions_are_kept() -> None:
    old = [{"type": "External", "status": "True", "lastTransitionTime": T0}]
    merged = merge_conditions(old, [{"type": "Ready", "status": "True"}], T1)
    assert [cond["type"] for cond in merged] == ["Ready", "External"]


def test_unchanged_status_produces_an_empty_patch() -> None:
    """Regression: writing identical status every timer tick floods the API server."""
    plan = plan_of()
    desired = compute_status(plan, all_ready(plan), [], 1)
    first = status_patch({}, desired, T0)
    assert set(first) >= {"conditions", "prefill", "decode", "observedGeneration"}
    assert status_patch(first, desired, T1) == {}
    newer = compute_status(plan, all_ready(plan), [], 2)
    # a change writes the whole snapshot (consistent even against a stale copy of `old`)
    assert set(status_patch(first, newer, T1)) == set(first)
    assert status_patch(first, newer, T1)["observedGeneration"] == 2


def test_fleet_wide_anomaly_degrades_but_keeps_ready() -> None:
    """Regression: a fleet-wide incident is not a capacity problem: Degraded, still Ready, and
    the condition has one writer (the anomaly loop only writes status.anomaly)."""
    plan = plan_of()
    anomaly = {"fleetWide": "7 of 8 decode pods anomalous", "signalUnavailable": None}
    conds = conditions(compute_status(plan, all_ready(plan), [], 1, anomaly))
    assert conds["Ready"]["status"] == "True"
    assert conds["Degraded"]["status"] == "True"
    assert conds["Degraded"]["reason"] == c.REASON_FLEET_ANOMALY
    assert conds[c.COND_ANOMALY_SIGNAL]["status"] == "True"


def test_unavailable_signal_is_a_condition_not_an_action() -> None:
    plan = plan_of()
    anomaly = {"fleetWide": None, "signalUnavailable": "prometheus unavailable: timeout"}
    conds = conditions(compute_status(plan, all_ready(plan), [], 1, anomaly))
    assert conds["Degraded"]["status"] == "False"
    signal = conds[c.COND_ANOMALY_SIGNAL]
    assert signal["status"] == "False" and "prometheus" in signal["message"]
    assert signal["reason"] == c.REASON_SIGNAL_UNAVAILABLE
    fresh = conditions(compute_status(plan, all_ready(plan), [], 1, None))
    assert fresh[c.COND_ANOMALY_SIGNAL]["reason"] == c.REASON_NOT_OBSERVED


def test_a_section_that_went_is_removed_by_the_merge_patch() -> None:
    """Regression: the status is written as a merge patch, so `status.rollout.canary` of an
    ended canary stayed on the resource (the scale-down loop then kept sizing both revisions
    and the old one was never found idle). A key that went is sent as null; a null that the
    server already dropped is no change."""
    old = {"rollout": {"phase": "Progressing", "canary": {"revision": "r2"}}, "conditions": []}
    new = {"rollout": {"phase": "Stable"}, "conditions": []}
    patch = status_patch(old, new, "2026-12-04T00:00:00Z")
    assert patch["rollout"] == {"phase": "Stable", "canary": None}
    assert status_patch({**old, **stored(patch)}, new, "2026-12-04T00:00:00Z") == {}

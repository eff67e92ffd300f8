"""Status of a CodingAgentServing, computed purely from the plan and the observed children.

Conditions follow Kubernetes conventions: `lastTransitionTime` changes only when a condition's
status flips, every condition carries `observedGeneration`, and `status_patch` returns the
whole status only when something changed, so an unchanged resource gets no status write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cas_operator.api import constants as c
from cas_operator.autoscale.signals import request_shape_status
from cas_operator.desired.admission import admission_for
from cas_operator.desired.plan import Plan, PoolPlan
from cas_operator.desired.recommend import ShapeAdvice, ShapePlan
from cas_operator.desired.resources.config import plan_summary
from cas_operator.desired.traffic import Sizes, Split
from cas_operator.rollout.state import Phase, RolloutState
from cas_operator.types import parse_time

Status = dict[str, Any]


@dataclass(frozen=True)
class ObservedWorkload:
    """A Deployment or LeaderWorkerSet child as last read from the API server."""

    kind: str
    name: str
    role: str
    revision: str
    replicas: int
    ready_replicas: int
    spec_hash: str | None
    up_to_date: bool  # the controller has observed the latest generation
    retiring_since: float | None = None  # an older revision's router, out of the entry point
    uid: str | None = None  # the object's (None: not read)
    owner_uid: str | None = None  # its controller's ("": none; None: not read)
    keys_version: str = ""  # the keys its pods take (`desired.resources.security`)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> ObservedWorkload:
        meta, spec, status = obj["metadata"], obj.get("spec", {}), obj.get("status") or {}
        labels = meta.get("labels", {})
        annotations = meta.get("annotations") or {}
        observed_generation = status.get("observedGeneration")
        refs: list[dict[str, Any]] = meta.get("ownerReferences") or []
        controller = next((r for r in refs if r.get("controller")), {})
        return cls(
            kind=obj.get("kind", "Deployment"),
            name=meta["name"],
            role=labels.get(c.LABEL_ROLE, ""),
            revision=labels.get(c.LABEL_REVISION, ""),
            replicas=int(spec.get("replicas", 0)),
            ready_replicas=int(status.get("readyReplicas", 0) or 0),
            spec_hash=annotations.get(c.ANNOTATION_SPEC_HASH),
            up_to_date=observed_generation is None or observed_generation >= meta["generation"],
            retiring_since=parse_time(annotations.get(c.ANNOTATION_RETIRING_SINCE)),
            uid=meta.get("uid"),
            owner_uid=str(controller.get("uid") or ""),
            keys_version=labels.get(c.LABEL_KEYS, ""),
        )

    def owned_by(self, owner_uid: str) -> bool:
        """Whether this workload is the resource of `owner_uid`'s (or unread: a fake's)."""
        return self.owner_uid is None or self.owner_uid == owner_uid

    @property
    def ready(self) -> bool:
        return self.up_to_date and self.ready_replicas >= self.replicas


@dataclass(frozen=True)
class Problem:
    """Something that makes the resource Degraded: a reason and a message naming the cause."""

    reason: str
    message: str


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def find_condition(status: Status, type_: str) -> dict[str, Any] | None:
    """The condition of `type_` in a status, found by type (never by position)."""
    return next((cd for cd in status.get("conditions", []) if cd.get("type") == type_), None)


def is_true(status: Status, type_: str) -> bool:
    found = find_condition(status, type_)
    return found is not None and found.get("status") == "True"


def merge_conditions(
    old: list[dict[str, Any]], new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Carry `lastTransitionTime` over unless the status flipped; keep conditions we don't own."""
    previous = {cond["type"]: cond for cond in old}
    merged = []
    for cond in new:
        before = previous.pop(cond["type"], None)
        unchanged = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime", now) if unchanged and before else now
        merged.append({**cond, "lastTransitionTime": stamp})
    merged.extend(previous.values())
    return merged


def pool_status(plan: Plan, pool: PoolPlan, observed: list[ObservedWorkload]) -> dict[str, Any]:
    current = [w for w in observed if w.role == pool.role and w.revision == plan.revision]
    ready = min(sum(w.ready_replicas for w in current), pool.replicas)
    selector = f"{c.LABEL_NAME}={plan.name},{c.LABEL_ROLE}={pool.role}"
    return {
        "replicas": pool.replicas,
        "readyReplicas": ready,
        "summary": f"{ready}/{pool.replicas}",
        "gpusPerInstance": pool.shape.gpus,
        "selector": selector,
    }


@dataclass(frozen=True)
class Readiness:
    """What the current revision waits for (nothing: ready) and the stale revisions left."""

    waiting: list[str]
    stale: list[str]

    @property
    def ready(self) -> bool:
        return not self.waiting


def _readiness(plan: Plan, observed: list[ObservedWorkload]) -> Readiness:
    """Whether the current revision is ready, what it waits for, and stale revisions left."""
    waiting = []
    for pool in plan.pools:
        current = [w for w in observed if w.role == pool.role and w.revision == plan.revision]
        if not current:
            waiting.append(f"{pool.role} workload not created yet")
        elif not all(w.ready for w in current):
            ready = sum(w.ready_replicas for w in current)
            waiting.append(f"{pool.role} {ready}/{pool.replicas} ready")
    routers = [w for w in observed if w.role == c.ROLE_ROUTER and w.revision == plan.revision]
    if not routers or not all(w.ready for w in routers):
        waiting.append("router not ready")
    stale = sorted({w.revision for w in observed if w.revision != plan.revision})
    return Readiness(waiting, stale)


def anomaly_findings(anomaly: dict[str, Any] | None) -> tuple[list[Problem], str | None]:
    """What the anomaly loop last wrote to `status.anomaly`: a fleet-wide incident (Degraded,
    not a pod problem) and whether its signal is unavailable (message) or not (None)."""
    anomaly = anomaly or {}
    problems = []
    if anomaly.get("fleetWide"):
        problems.append(Problem(c.REASON_FLEET_ANOMALY, str(anomaly["fleetWide"])))
    return problems, anomaly.get("signalUnavailable")


def _signal_condition(anomaly: dict[str, Any] | None, generation: int) -> dict[str, Any]:
    _, unavailable = anomaly_findings(anomaly)
    if anomaly is None:
        return condition(
            c.COND_ANOMALY_SIGNAL, False, c.REASON_NOT_OBSERVED, "no data yet", generation
        )
    if unavailable:
        return condition(
            c.COND_ANOMALY_SIGNAL, False, c.REASON_SIGNAL_UNAVAILABLE, unavailable, generation
        )
    return condition(c.COND_ANOMALY_SIGNAL, True, c.REASON_AS_EXPECTED, "", generation)


@dataclass(frozen=True)
class RolloutView:
    """A Canary fleet's rollout as one pass saw it: loop 4's state and the split the pass
    applied (`desired.traffic`)."""

    state: RolloutState
    split: Split
    traffic: Status  # the traffic objects the spec has (`reconcile.core.traffic_objects`)


def revision_waiting(revision: str, observed: list[ObservedWorkload], label: str) -> list[str]:
    """What one revision's pools and router wait for (empty: all exist and are Ready)."""
    waiting = []
    for role in (*c.POOL_ROLES, c.ROLE_ROUTER):
        mine = [w for w in observed if w.revision == revision and w.role == role]
        if not mine:
            waiting.append(f"{label} {role} missing")
        elif not all(w.ready for w in mine):
            ready, wanted = sum(w.ready_replicas for w in mine), sum(w.replicas for w in mine)
            waiting.append(f"{label} {role} {ready}/{wanted} ready")
    return waiting


def _sizes_status(revision: str, sizes: Sizes, observed: list[ObservedWorkload]) -> dict[str, Any]:
    """One revision's pools as `status.rollout.stable` / `.canary` show them."""
    out: dict[str, Any] = {"revision": revision}
    for role, wanted in (
        (c.ROLE_PREFILL, sizes.prefill),
        (c.ROLE_DECODE, sizes.decode),
        (c.ROLE_ROUTER, sizes.routers),
    ):
        mine = [w for w in observed if w.revision == revision and w.role == role]
        ready = min(sum(w.ready_replicas for w in mine), wanted)
        out[role] = {"replicas": wanted, "readyReplicas": ready}
    return out


def rollout_status(
    view: RolloutView, observed: list[ObservedWorkload], traffic: Status
) -> dict[str, Any]:
    """`status.rollout`: loop 4's state, the traffic split and each revision's pools. The
    canary's `readyStep` is the step whose sizes its pools are Ready at (loop 4 moves traffic
    to a step only then)."""
    state, split = view.state, view.split
    out = state.to_status()
    weight = split.weight if split.canary is not None and not split.waiting else 0
    out["traffic"] = {
        **traffic,
        "canaryWeight": weight,
        "precision": split.precision or None,
        "waiting": split.waiting or None,
    }
    out["traffic"] = {k: v for k, v in out["traffic"].items() if v is not None}
    if split.stable_sizes is not None:
        out["stable"] = _sizes_status(split.stable, split.stable_sizes, observed)
    if split.canary is not None:
        canary = _sizes_status(split.canary, split.current_sizes, observed)
        ready = not revision_waiting(split.canary, observed, "canary") and all(
            w.replicas == canary[w.role]["replicas"]
            for w in observed
            if w.revision == split.canary and w.role in canary
        )
        if ready:
            canary["readyStep"] = split.sized_step
        out["canary"] = canary
        out["summary"] = f"{split.canary} {weight}%"
    return out


def _rollout_conditions(
    view: RolloutView,
    observed: list[ObservedWorkload],
    retiring: tuple[str, ...],
    generation: int,
) -> tuple[list[str], dict[str, Any], Problem | None]:
    """What Ready waits for (the revisions that receive requests), the Progressing
    condition, and the abort as a Degraded problem."""
    state, split = view.state, view.split
    waiting = []
    for revision in sorted(split.serving):
        label = "canary" if revision == split.canary else f"revision {revision}"
        waiting += revision_waiting(revision, observed, label)
    if state.phase == Phase.ABORTED and split.canary is None:
        message = "; ".join((state.reason, *retiring))
        progressing = condition(
            c.COND_PROGRESSING, False, c.REASON_ROLLOUT_ABORTED, message, generation
        )
        return waiting, progressing, Problem(c.REASON_ROLLOUT_ABORTED, state.reason)
    if split.canary is not None:
        reason = {
            Phase.PAUSED: c.REASON_ROLLOUT_PAUSED,
            Phase.PROMOTING: c.REASON_PROMOTING,
        }.get(state.phase, c.REASON_CANARY)
        canary_waits = revision_waiting(split.canary, observed, "canary")
        parts = (state.reason, *canary_waits, split.waiting, *retiring)
        message = "; ".join(p for p in parts if p)
        return waiting, condition(c.COND_PROGRESSING, True, reason, message, generation), None
    if retiring:
        message = "; ".join((f"serving revision {split.stable}", *retiring))
        progressing = condition(c.COND_PROGRESSING, True, c.REASON_ROLLING, message, generation)
        return waiting, progressing, None
    if waiting:
        message = "; ".join(waiting)
        progressing = condition(c.COND_PROGRESSING, True, c.REASON_WAITING, message, generation)
        return waiting, progressing, None
    done = condition(c.COND_PROGRESSING, False, c.REASON_RECONCILED, "up to date", generation)
    return waiting, done, None


def compute_status(
    plan: Plan,
    observed: list[ObservedWorkload],
    problems: list[Problem],
    generation: int,
    anomaly: dict[str, Any] | None = None,
    *,
    entry: str | None = None,
    retiring: tuple[str, ...] = (),
    rollout: RolloutView | None = None,
) -> Status:
    """The full desired status (without conditions' transition times).

    `entry` is the revision the entry Service sends to (`status.servingRevision`; None: every
    revision's routers), `retiring` says how each older revision's retire is going, `rollout`
    a Canary fleet's rollout (Ready then means: every revision that receives requests is
    Ready; Progressing follows the rollout; an abort makes it Degraded).

    `problems` (failed applies, missing APIs) make the resource Degraded and not Ready; the
    fleet tick's findings (`status.anomaly`, handed to the pass that writes this status) only make
    it Degraded.
    """
    readiness = _readiness(plan, observed)
    waiting, stale = readiness.waiting, readiness.stale
    rolled: dict[str, Any] | None = None
    if rollout is not None:
        waiting, rolled, aborted = _rollout_conditions(rollout, observed, retiring, generation)
        problems = [*problems, aborted] if aborted is not None else problems
    ready = not waiting and not problems
    summary = plan_summary(plan)
    degradations = [*problems, *anomaly_findings(anomaly)[0]]
    if degradations:
        degraded = condition(
            c.COND_DEGRADED,
            True,
            degradations[0].reason,
            "; ".join(p.message for p in degradations),
            generation,
        )
    else:
        degraded = condition(c.COND_DEGRADED, False, c.REASON_AS_EXPECTED, "", generation)
    if ready:
        ready_cond = condition(
            c.COND_READY, True, c.REASON_ALL_READY, "all pools ready", generation
        )
    else:
        message = "; ".join(waiting) or "see Degraded"
        ready_cond = condition(c.COND_READY, False, c.REASON_WAITING, message, generation)
    if rolled is not None:
        progressing = rolled
    elif stale:
        progressing = condition(
            c.COND_PROGRESSING,
            True,
            c.REASON_ROLLING,
            "; ".join((f"rolling to revision {plan.revision} from {', '.join(stale)}", *retiring)),
            generation,
        )
    elif waiting:
        progressing = condition(
            c.COND_PROGRESSING, True, c.REASON_WAITING, "; ".join(waiting), generation
        )
    else:
        progressing = condition(
            c.COND_PROGRESSING, False, c.REASON_RECONCILED, "up to date", generation
        )
    pools = {
        role: pool_status(plan, pool, observed)
        for role, pool in zip(c.POOL_ROLES, plan.pools, strict=True)
    }
    if rollout is not None and not rollout.split.build_current and rollout.split.stable_sizes:
        pools = _serving_pools(plan, rollout.split, observed)
    return {
        "observedGeneration": generation,
        "revision": plan.revision,
        "servingRevision": entry,
        "engineInput": plan.engine_input,
        "keysVersion": plan.keys_version or None,
        "heldRevision": held_revision(plan),
        "warnings": list(plan.warnings) or None,
        "conditions": [ready_cond, progressing, degraded, _signal_condition(anomaly, generation)],
        "prefill": pools[c.ROLE_PREFILL],
        "decode": pools[c.ROLE_DECODE],
        **(
            {"rollout": rollout_status(rollout, observed, rollout.traffic)}
            if rollout is not None
            else {}
        ),
        "ratio": ratio_status(plan),
        "admission": admission_status(plan),
        "layerSplit": summary.get("layerSplit"),
        "gpus": summary["gpus"],
    }


def _serving_pools(
    plan: Plan, split: Split, observed: list[ObservedWorkload]
) -> dict[str, dict[str, Any]]:
    """`status.<pool>` of an aborted canary's fleet: the stable revision's pools, which serve."""
    assert split.stable_sizes is not None
    stable = plan.at_revision(split.stable).sized(
        split.stable_sizes.prefill, split.stable_sizes.decode, split.stable_sizes.routers
    )
    return {
        role: pool_status(stable, pool, observed)
        for role, pool in zip(c.POOL_ROLES, stable.pools, strict=True)
    }


def admission_status(plan: Plan) -> dict[str, Any]:
    """`status.admission`: the limits the routers of the spec's revision enforce, or why none."""
    mode = plan.spec.router.admission.mode.value
    measured: dict[str, Any] = {}
    if plan.refused_rate is not None:
        measured["refusedPerSecond"] = plan.refused_rate
    if plan.measured_shape is not None:
        measured["requestShape"] = request_shape_status(plan.measured_shape)
    found = admission_for(plan)
    if found is None:
        why = "no limit" if mode == "Off" else f"no instance profile for {plan.spec.model.name}"
        return {"mode": mode, "basis": why, **measured}
    limits = found.to_status(plan.router_replicas, plan.spec.router.implementation)
    return {"mode": mode, **limits, **measured}


def held_revision(plan: Plan) -> dict[str, str] | None:
    """`status.heldRevision`: what this operator would roll the engines to, while held (None
    clears it: the status is written as a merge patch)."""
    if not plan.held:
        return None
    return {
        "revision": plan.rendered_revision,
        "message": "this operator version renders the engine pods differently; they keep "
        f"running as revision {plan.revision} until the spec changes or "
        "spec.rollout.onOperatorUpgrade is Roll",
    }


def ratio_status(plan: Plan) -> dict[str, Any]:
    """Current P:D, who owns the replica counts, and the planner's recommendation if asked."""
    mode = plan.spec.ratio.mode.value
    status: dict[str, Any] = {
        "mode": mode,
        "current": plan.replicas.ratio,
        "reason": plan.replicas.reason,
        "replicasOwner": "operator (Auto)" if mode == "Auto" else "spec",
    }
    rec = plan.recommendation
    if rec is not None:
        status["recommended"] = rec.ratio
        status["recommendationReason"] = rec.reason
        if rec.ratio is not None:
            status["predicted"] = {
                "ttftP90Seconds": rec.ttft_p90_seconds,
                "itlMilliseconds": rec.itl_milliseconds,
                "hitRate": rec.hit_rate,
                "hitRateCurve": rec.hit_rate_curve,
                "meetsSlo": rec.meets_slo,
            }
        if rec.shape is not None:
            status["prefillShape"] = shape_status(rec.shape)
    return status


def shape_status(advice: ShapeAdvice) -> dict[str, Any]:
    """`status.ratio.prefillShape`: the running and the cheapest valid prefill shape with the
    planner's GPUs and TTFT for each (advice only: a shape change is a new revision)."""

    def shape(plan: ShapePlan) -> dict[str, Any]:
        return {
            "contextParallel": plan.context_parallel,
            "layerSplit": plan.layer_split,
            "replicas": f"{plan.prefill}:{plan.decode}",
            "gpus": plan.gpus,
            "ttftP90Seconds": plan.ttft_p90_seconds,
            "meetsSlo": plan.meets_slo,
            "goodputRps": plan.goodput_rps,
        }

    return {
        "current": shape(advice.current),
        "recommended": shape(advice.recommended),
        "reason": advice.reason,
    }


def invalid_status(message: str, generation: int) -> Status:
    """Status for a spec that cannot be planned: Degraded/InvalidSpec, not Ready."""
    return {
        "observedGeneration": generation,
        "conditions": [
            condition(c.COND_READY, False, c.REASON_INVALID_SPEC, message, generation),
            condition(c.COND_PROGRESSING, False, c.REASON_INVALID_SPEC, message, generation),
            condition(c.COND_DEGRADED, True, c.REASON_INVALID_SPEC, message, generation),
        ],
    }


def status_patch(old: Status, new: Status, now: str) -> Status:
    """Empty when nothing changed; else the WHOLE new status (conditions keep their times).

    Whole, not only the changed keys: two writers (the spec/timer handlers and the child-event
    refresh) may hold different stale copies of the old status, and a partial patch computed
    against a stale copy can pair a Ready condition with another pass's replica counts. A
    whole snapshot is always internally consistent.
    """
    new = {**new, "conditions": merge_conditions(old.get("conditions", []), new["conditions"], now)}
    changed = any(stored(old.get(key)) != stored(value) for key, value in new.items())
    return {key: removing(old.get(key), value) for key, value in new.items()} if changed else {}


def stored(value: Any) -> Any:
    """`value` as the API server keeps it after a merge patch: no null inside an object."""
    if isinstance(value, dict):
        return {k: stored(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [stored(v) for v in value]
    return value


def removing(old: Any, new: Any) -> Any:
    """`new` with a null for every key of `old` it no longer has, at any depth of nested
    objects: a merge patch leaves a key it does not name as it was (a canary section after
    the canary ended, say), so the whole new status must name the ones that went."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {k: removing(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out

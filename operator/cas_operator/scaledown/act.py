"""The scale-down loop's act step: one tick over one resource's pools.

Entry point: `scale_down_tick(api, pods, signals, status, drain_seconds, now)`, called by the
fleet tick after the anomaly loop, with the engine instances it listed (one pod each: LWS
leaders only, none being deleted) and their signals. Per pool of the current revision
(`status.revision`), or of both revisions of a canary rollout, against the desired count the
last pass wrote (`desired_pools`):
read each pod as a `decide.Instance`, decide (`decide.retire_step`, pure), then patch the pods:
marks take a pod out of rotation (the serving label off; the anomaly loop deregisters every pod
out of rotation from every router, every tick), a release gives it the lowest pod-deletion-cost,
a restore puts it back. The result's `floors` tell the reconcile how far each workload may
shrink (`decide.replicas_to_apply`), and `older` how much work each older revision still
runs (its retire waits for it: `decide.retire_revision`): every revision without a desired
count. Ownership: `api` does all API I/O;
nothing is kept between ticks (the state is on the pods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cas_operator.anomaly.act import PodApi
from cas_operator.anomaly.drain import (
    ANNOTATION_DRAIN_REASON,
    ANNOTATION_DRAIN_STATE,
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_EVICTION_BLOCKED,
    RETIRE_STATES,
    STATE_RELEASED,
    STATE_RETIRING,
    drain_marks,
    drain_state,
    draining_since,
    is_ready,
)
from cas_operator.api import constants as c
from cas_operator.observe.types import PodSignals
from cas_operator.scaledown.decide import (
    Instance,
    PoolFloor,
    RetirePolicy,
    RetireStep,
    RevisionLoad,
    retire_step,
)
from cas_operator.types import Event, Manifest, Status


@dataclass(frozen=True)
class ScaleDownResult:
    events: list[Event] = field(default_factory=list)
    floors: tuple[PoolFloor, ...] = ()
    older: tuple[RevisionLoad, ...] = ()  # the work of every older revision still running


def work_of(signals: PodSignals | None) -> float | None:
    """Running + queued requests + KV transfers in flight; None when not measured."""
    if signals is None or signals.error is not None or signals.running is None:
        return None
    return signals.running + (signals.queued or 0.0) + (signals.kv_transfers or 0.0)


def instance_of(pod: Manifest, signals: PodSignals | None) -> Instance:
    meta = pod["metadata"]
    labels = meta.get("labels", {})
    since = draining_since(pod)
    state = drain_state(pod) if since is not None else None
    group = labels.get(c.LWS_GROUP_INDEX_LABEL)
    return Instance(
        name=meta["name"],
        work=work_of(signals),
        ready=is_ready(pod),
        state=state if state in RETIRE_STATES else None,
        retiring_since=since if state in RETIRE_STATES else None,
        group_index=int(group) if group is not None and group.isdigit() else None,
        drained_by_anomaly=state is not None and state not in RETIRE_STATES,
    )


def restore_patch() -> Manifest:
    """Back in rotation: the serving label, and none of the retire marks."""
    gone: dict[str, Any] = dict.fromkeys(
        (
            ANNOTATION_DRAINING_SINCE,
            ANNOTATION_DRAIN_REASON,
            ANNOTATION_DRAIN_STATE,
            ANNOTATION_EVICTION_BLOCKED,
            c.ANNOTATION_POD_DELETION_COST,
        )
    )
    return {"metadata": {"labels": {c.LABEL_SERVING: "true"}, "annotations": gone}}


def _act(
    api: PodApi, namespace: str, role: str, step: RetireStep, why: str, now: float
) -> list[Event]:
    events: list[Event] = []
    for name in step.mark:
        marks = drain_marks(why, now)
        marks["annotations"][ANNOTATION_DRAIN_STATE] = STATE_RETIRING
        api.patch("Pod", namespace, name, {"metadata": marks})
        events.append(("Normal", "PodRetiring", f"pod {name} out of rotation: {why}"))
    for name in step.release:
        released = {ANNOTATION_DRAIN_STATE: STATE_RELEASED}
        released[c.ANNOTATION_POD_DELETION_COST] = c.LOWEST_DELETION_COST
        api.patch("Pod", namespace, name, {"metadata": {"annotations": released}})
        events.append(("Normal", "PodReleased", f"pod {name} idle: {role} pool may shrink"))
    for name in step.restore:
        api.patch("Pod", namespace, name, restore_patch())
        events.append(("Normal", "PodRestored", f"pod {name} back in rotation: {role} pool kept"))
    return events


def scale_down_tick(
    api: PodApi,
    pods: list[Manifest],
    signals: Mapping[str, PodSignals | None],
    status: Status,
    drain_seconds: float,
    now: float,
    policy: RetirePolicy | None = None,
) -> ScaleDownResult:
    """One tick of every pool's scale-down (see the module docstring)."""
    pools = desired_pools(status)
    if not pools:
        return ScaleDownResult()
    policy = policy or RetirePolicy(max_wait_seconds=drain_seconds)
    events: list[Event] = []
    floors = []
    for (revision, role), desired in sorted(pools.items()):
        mine = [
            p
            for p in pods
            if p["metadata"].get("labels", {}).get(c.LABEL_ROLE) == role
            and p["metadata"].get("labels", {}).get(c.LABEL_REVISION) == revision
        ]
        if not mine:
            continue
        instances = [instance_of(p, signals.get(p["metadata"]["name"])) for p in mine]
        step = retire_step(desired, instances, now, policy)
        why = f"scale-down of the {role} pool from {len(instances)} to {desired} instances"
        namespace = str(mine[0]["metadata"].get("namespace", ""))
        events += _act(api, namespace, role, step, why, now)
        floors.append(PoolFloor(revision, role, step.keep, len(instances)))
    kept = frozenset(revision for revision, _ in pools)
    return ScaleDownResult(events, tuple(floors), other_revisions(pods, signals, kept))


def desired_pools(status: Status) -> dict[tuple[str, str], int]:
    """Each pool's desired instance count by (revision, role), as the last pass wrote it:
    the current revision's (`status.revision`, `status.<pool>.replicas`), or during a canary
    rollout the stable and the canary revision's (`status.rollout.stable` / `.canary`)."""
    rollout = status.get("rollout") or {}
    out: dict[tuple[str, str], int] = {}
    if rollout.get("stable"):
        for section in (rollout.get("stable"), rollout.get("canary")):
            revision = (section or {}).get("revision")
            for role in c.POOL_ROLES:
                count = ((section or {}).get(role) or {}).get("replicas")
                if revision and count is not None:
                    out[(str(revision), role)] = int(count)
        return out
    revision = status.get("revision")
    for role in c.POOL_ROLES:
        count = (status.get(role) or {}).get("replicas")
        if revision and count is not None:
            out[(str(revision), role)] = int(count)
    return out


def other_revisions(
    pods: list[Manifest], signals: Mapping[str, PodSignals | None], kept: frozenset[str]
) -> tuple[RevisionLoad, ...]:
    """The work of every revision not `kept` (their retire waits for it)."""
    work: dict[str, float | None] = {}
    for pod in pods:
        revision = pod["metadata"].get("labels", {}).get(c.LABEL_REVISION, "")
        if revision in kept:
            continue
        before = work.setdefault(revision, 0.0)
        if not is_ready(pod):
            continue
        mine = work_of(signals.get(pod["metadata"]["name"]))
        work[revision] = None if before is None or mine is None else before + mine
    return tuple(RevisionLoad(r, w) for r, w in sorted(work.items()))

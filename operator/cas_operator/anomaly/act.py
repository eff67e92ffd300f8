"""The anomaly loop's act step, and the one tick that runs observe -> decide -> act.

Entry point: `anomaly_tick(api, source, ...)`, called by the fleet tick once per resource:
1. list the engine pods; 2. observe them over the guard's window (`source`);
3. decide (`anomaly.detect.decide`, pure); 4. start the drains it ordered (label off,
annotations: `anomaly.drain`), take out of rotation every LWS leader whose group has a pod
leaving (`anomaly.groups`), and deregister every draining or deleted instance from every
router replica (`routers.py`); 5. advance drains in progress (`anomaly.drain.next_step`):
hold or delete; 6. report `status.draining`, the Degraded messages, per-pool anomaly rates,
and the pods with their signals (`TickResult.views`, which the autoscale loop reads).
Ownership: `api` (the operator's `Kube`) does all API I/O; `source` all metrics I/O; the caller
keeps the returned `LoopState` in memory for the next tick and posts the returned events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cas_operator.anomaly.detect import AnomalyDecision, GuardState, Policy, decide
from cas_operator.anomaly.drain import (
    ANNOTATION_DRAIN_STATE,
    ANNOTATION_EVICTION_BLOCKED,
    STATE_HELD,
    DrainPolicy,
    _drained_why,
    _held,
    _meta,
    drain_marks,
    draining_since,
    draining_status,
    is_group_worker,
    next_step,
    view_of,
)
from cas_operator.anomaly.groups import groups_leaving
from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec, GuardAction
from cas_operator.observe.types import MetricsSource, Observation, PodTarget, PodView
from cas_operator.routers import HttpRouters, Routers, router_endpoints
from cas_operator.types import Event, Manifest, rfc3339


class PodApi(Protocol):
    """The three `Kube` calls this module uses (`cas_operator.kube.Kube` satisfies it)."""

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest: ...

    def delete(self, kind: str, namespace: str, name: str) -> None: ...

    def evict(self, namespace: str, name: str, uid: str | None) -> bool: ...


@dataclass
class LoopState:
    """What the caller keeps per custom resource between ticks (in memory only)."""

    guard: GuardState = field(default_factory=GuardState)
    canary: GuardState = field(default_factory=GuardState)  # a canary revision's own pods


@dataclass
class TickResult:
    """One tick's outcome for the caller to publish.

    `draining` is the status list (`status.draining`); `degraded` / `unavailable` are
    messages for the Degraded condition (reasons `FleetWideAnomaly` / `AnomalySignalUnavailable`)
    or None; `pool_rate` feeds `status.<pool>.anomalyRate`.
    """

    events: list[Event]
    draining: list[dict[str, Any]]
    degraded: str | None
    unavailable: str | None
    pool_rate: dict[str, float | None]
    decision: AnomalyDecision | None = None
    views: list[PodView] = field(default_factory=list)  # the pods left, with their signals
    pods: list[Manifest] = field(default_factory=list)  # the same pods, as listed and marked
    canary_anomaly: str | None = None  # a canary revision's pods judged anomalous


def all_engine_pods(api: PodApi, namespace: str, name: str) -> list[Manifest]:
    """Every engine pod of the resource: instances, LWS group workers, deleting ones."""
    return api.list("Pod", namespace, {c.LABEL_NAME: name, c.LABEL_APP_NAME: c.APP_ENGINE})


def instances(pods: list[Manifest]) -> list[Manifest]:
    """The engine instances among `pods`, one pod each, not already being deleted.

    A multi-node instance is its leader pod: only the leader serves (the router knows only
    it) and exports the instance's metrics, so it is what is observed, judged and drained.
    Deleting it replaces the whole group (the LWS restart policy is RecreateGroupOnPodRestart),
    and holding it out of rotation holds the group; the worker pods are never touched here."""
    return [p for p in pods if not _meta(p).get("deletionTimestamp") and not is_group_worker(p)]


def engine_pods(api: PodApi, namespace: str, name: str) -> list[Manifest]:
    """This resource's engine instances (`instances`)."""
    return instances(all_engine_pods(api, namespace, name))


def leaving(pods: list[Manifest]) -> list[Manifest]:
    """The engine instances among `pods` being deleted (a scale-down, a retired revision, an
    eviction): their preStop hook lets them finish what they run, but the router (0.3.2)
    keeps sending a deleted pod new requests (measured: 6 of 12 within 7 s), so they must
    leave every router too."""
    return [p for p in pods if _meta(p).get("deletionTimestamp") and not is_group_worker(p)]


def leave_with_group(
    api: PodApi, listed: list[Manifest], serving: list[Manifest], now: float
) -> list[Event]:
    """Take out of rotation every leader whose LeaderWorkerSet group has a pod leaving
    (`anomaly.groups`): one still running starts a drain (label off, annotations; the drain
    path then removes it once idle); one being deleted already loses its serving label. Both
    are then deregistered from every router replica by `deregister_leaving`. `serving` are
    the instances of this tick (their copies are marked as patched)."""
    events: list[Event] = []
    by_name = {_meta(p)["name"]: p for p in serving}
    deleting = {_meta(p)["name"]: p for p in leaving(listed)}
    for found in groups_leaving(listed):
        running = by_name.get(found.leader)
        if running is not None and draining_since(running) is None:
            events.append(start_drain(api, running, found.reason, now))
            _mark_draining(running, found.reason, now)
        gone = deleting.get(found.leader)
        if gone is not None and _meta(gone).get("labels", {}).get(c.LABEL_SERVING):
            meta = _meta(gone)
            unlabel = {"metadata": {"labels": {c.LABEL_SERVING: None}}}
            api.patch("Pod", meta["namespace"], meta["name"], unlabel)
            meta["labels"].pop(c.LABEL_SERVING, None)
            events.append(("Normal", "PodOutOfRotation", f"pod {meta['name']}: {found.reason}"))
    return events


def start_drain(api: PodApi, pod: Manifest, reason: str, now: float) -> Event:
    """Take the pod out of rotation and record why and since when, in one merge patch."""
    meta = _meta(pod)
    api.patch("Pod", meta["namespace"], meta["name"], {"metadata": drain_marks(reason, now)})
    return ("Warning", "PodDraining", f"pod {meta['name']} out of rotation: {reason}")


def advance_drains(
    api: PodApi,
    pods: list[Manifest],
    observation: Observation,
    action: GuardAction,
    now: float,
    policy: DrainPolicy,
) -> tuple[list[Event], set[str]]:
    """Move every draining pod one step; returns events and the names removed this tick.

    A pod is removed through the Eviction API with its uid as a precondition; while a
    PodDisruptionBudget refuses, it stays (out of rotation) and is tried again next tick, and
    the refusal is recorded once on the pod (`cas.dev/eviction-blocked`) with one event."""
    events: list[Event] = []
    removed: set[str] = set()
    for pod in pods:
        meta = _meta(pod)
        signals = observation.signals.get(meta["name"])
        running = signals.running if signals is not None and signals.error is None else None
        step = next_step(pod, running, action, now, policy)
        if step == "delete":
            if api.evict(meta["namespace"], meta["name"], meta.get("uid")):
                removed.add(meta["name"])
                why = "held long enough" if _held(pod) else _drained_why(running)
                events.append(("Normal", "PodReplaced", f"pod {meta['name']} evicted ({why})"))
            elif ANNOTATION_EVICTION_BLOCKED not in meta.get("annotations", {}):
                mark = {"metadata": {"annotations": {ANNOTATION_EVICTION_BLOCKED: rfc3339(now)}}}
                api.patch("Pod", meta["namespace"], meta["name"], mark)
                meta.setdefault("annotations", {}).update(mark["metadata"]["annotations"])
                events.append(
                    (
                        "Warning",
                        "EvictionBlocked",
                        f"pod {meta['name']}: a PodDisruptionBudget refuses its eviction; retrying",
                    )
                )
        elif step == "hold":
            patch = {"metadata": {"annotations": {ANNOTATION_DRAIN_STATE: STATE_HELD}}}
            api.patch("Pod", meta["namespace"], meta["name"], patch)
            meta.setdefault("annotations", {})[ANNOTATION_DRAIN_STATE] = STATE_HELD
            events.append(
                ("Normal", "PodHeld", f"pod {meta['name']} drained, held out of rotation")
            )
    return events, removed


def deregister_leaving(pods: list[Manifest], routers: Routers) -> list[Event]:
    """Make sure no router replica still lists a draining pod or one being deleted
    (level-based, every tick)."""
    events: list[Event] = []
    for pod in pods:
        meta = _meta(pod)
        ip = pod.get("status", {}).get("podIP")
        leaving = draining_since(pod) is not None or meta.get("deletionTimestamp")
        if not leaving or not ip:
            continue
        for line in routers.deregister(f"http://{ip}:{c.ENGINE_PORT}"):
            kind = "Warning" if "unreachable" in line else "Normal"
            events.append(
                (
                    kind,
                    "WorkerDeregistered" if kind == "Normal" else "RouterUnreachable",
                    f"pod {meta['name']}: {line}",
                )
            )
    return events


def anomaly_tick(
    api: PodApi,
    source: MetricsSource,
    *,
    name: str,
    namespace: str,
    spec: AnomalyGuardSpec,
    state: LoopState,
    now: float,
    policy: Policy | None = None,
    drain_policy: DrainPolicy | None = None,
    routers: Routers | None = None,
    desired: dict[str, int] | None = None,
    canary: str | None = None,
) -> TickResult:
    """One observe -> decide -> act pass for one CodingAgentServing.

    Inputs: the API seam and metrics source, the resource's name/namespace, its parsed
    `spec.anomalyGuard`, the LoopState from the previous tick (mutated in place), and wall
    time `now` (epoch seconds; the drain annotations are wall-clock). Steps:
    1. list the engine pods; 2. observe them over `spec.window_seconds`;
    3. decide (pure); 4. start the drains it ordered (label off, annotations) and deregister
    every draining pod, and every pod being deleted, from every router replica (`routers`,
    default: the resource's router pods over HTTP); 5. advance drains in progress;
    6. report status.draining, the Degraded messages and per-pool anomaly rates.
    `desired` is each pool's desired instance count (the circuit breaker counts missing ones).
    `canary`: the revision a canary rollout runs; its pods are judged apart, against their own
    pool (the others' baseline stays clean), and never drained: the rollout aborts on what
    this finds (`TickResult.canary_anomaly`).
    """
    drain_policy = drain_policy or DrainPolicy()
    listed = all_engine_pods(api, namespace, name)
    pods = instances(listed)
    observation = source.observe([PodTarget.of(p) for p in pods], float(spec.window_seconds))
    events: list[Event] = []
    decision: AnomalyDecision | None = None
    canary_anomaly: str | None = None
    if spec.enabled:
        views = [view_of(p, observation.signals.get(_meta(p)["name"])) for p in pods]
        in_canary = {_meta(p)["name"] for p in pods if canary and revision_of(p) == canary}
        decision = decide(
            spec, [v for v in views if v.name not in in_canary], state.guard, now, policy, desired
        )
        state.guard = decision.state
        events += decision.events
        canary_anomaly = _judge_canary(
            spec, [v for v in views if v.name in in_canary], state, now, policy
        )
        by_name = {_meta(p)["name"]: p for p in pods}
        for order in decision.drains:
            events.append(start_drain(api, by_name[order.name], order.reason, now))
            _mark_draining(by_name[order.name], order.reason, now)
    events += leave_with_group(api, listed, pods, now)
    routers = routers or HttpRouters(router_endpoints(api, namespace, name))
    events += deregister_leaving(pods + leaving(listed), routers)
    stepped, deleted = advance_drains(api, pods, observation, spec.action, now, drain_policy)
    events += stepped
    remaining = [p for p in pods if _meta(p)["name"] not in deleted]
    views = [view_of(p, observation.signals.get(_meta(p)["name"])) for p in remaining]
    return TickResult(
        events=events,
        draining=draining_status(remaining, observation),
        degraded=decision.degraded if decision else None,
        unavailable=(decision.unavailable if decision else None) or observation.error,
        pool_rate=decision.pool_rate if decision else {},
        decision=decision,
        views=views,
        pods=remaining,
        canary_anomaly=canary_anomaly,
    )


def revision_of(pod: Manifest) -> str | None:
    found: str | None = _meta(pod).get("labels", {}).get(c.LABEL_REVISION)
    return found


def _judge_canary(
    spec: AnomalyGuardSpec,
    views: list[PodView],
    state: LoopState,
    now: float,
    policy: Policy | None,
) -> str | None:
    """A canary revision's pods, judged against each other with the same rules but never
    drained: an incident among them, or any pod hot for long enough, is the canary's
    anomaly (None: none, or no canary pods)."""
    if not views:
        state.canary = GuardState()
        return None
    observe_only = spec.model_copy(update={"action": GuardAction.OBSERVE})
    found = decide(observe_only, views, state.canary, now, policy)
    state.canary = found.state
    if found.degraded is not None:
        return found.degraded
    enter = (policy or Policy()).enter_observations
    hot = sorted(n for n, streak in found.state.hot_streak.items() if streak >= enter)
    if not hot:
        return None
    reasons = ", ".join(f"{n} ({found.verdicts[n].reason})" for n in hot if n in found.verdicts)
    return f"canary pods anomalous: {reasons}"


def _mark_draining(pod: Manifest, reason: str, now: float) -> None:
    """Mirror start_drain's patch on our copy, so this tick's later steps see it."""
    meta = _meta(pod)
    marks = drain_marks(reason, now)
    meta.setdefault("labels", {}).pop(c.LABEL_SERVING, None)
    meta.setdefault("annotations", {}).update(marks["annotations"])

"""The anomaly loop's act step, and the one tick that runs observe -> decide -> act.

Drain, as the pods record it (level-based: every step is re-derived from the pods each tick, so
a restarted operator resumes drains in progress from what it observes, never from memory):

    in rotation --start_drain--> Draining --running == 0 or grace over--> Replace: deleted
    (label cas.dev/serving=true)  (label removed; annotations     |        (its controller makes
                                   draining-since, drain-reason)   |         a fresh pod)
                                                                   +-----> Drain: Held (state
                                                                            annotation), deleted
                                                                            after hold_seconds
Removing the label is what takes the pod out of rotation for any label-based discovery, and the
workload selector does not include it, so the pod keeps its owner. The SGLang router (0.3.2)
does not drop a worker whose pod merely stops matching its selector (its watch ignores the
"no longer matches" event; measured on the local stack), so every tick also deregisters each
draining pod from every router replica (`GET /workers`, `DELETE /workers/{id}`; idempotent).

A multi-node instance (LeaderWorkerSet group) is observed, judged and drained as its leader
pod; deleting the leader makes LWS recreate the whole group (see `engine_pods`).

Entry point for the operator's anomaly loop: `guard_tick(api, source, ...)` (see its docstring).
Ownership: `api` (the operator's `Kube`) does all API I/O; `source` all metrics I/O; the caller
keeps the returned `LoopState` in memory for the next tick and posts the returned events.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec, GuardAction
from cas_operator.observe.types import MetricsSource, Observation, PodTarget
from cas_operator.planning.anomaly import (
    AnomalyDecision,
    GuardState,
    PodSignals,
    PodView,
    Policy,
    PoolCounts,
    PressureState,
    ScaleBounds,
    ScaleOutcome,
    decide,
    suggest_scale,
)

ANNOTATION_DRAINING_SINCE: Final = "cas.dev/draining-since"
ANNOTATION_DRAIN_REASON: Final = "cas.dev/drain-reason"
ANNOTATION_DRAIN_STATE: Final = "cas.dev/drain-state"
STATE_DRAINING: Final = "Draining"
STATE_HELD: Final = "Held"
Event = tuple[str, str, str]  # (type, reason, message), posted on the custom resource
Manifest = dict[str, Any]


class PodApi(Protocol):
    """The three `Kube` calls this module uses (`cas_operator.kube.Kube` satisfies it)."""

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest: ...

    def delete(self, kind: str, namespace: str, name: str) -> None: ...


@dataclass(frozen=True)
class DrainPolicy:
    """How long a drain waits: at least `min_wait_seconds` (the router must see the label go and
    a scrape must postdate it, so "0 running" is not a reading from before the drain), at most
    `grace_seconds` for running requests to finish; Drain holds a pod `hold_seconds`."""

    min_wait_seconds: float = 15.0
    grace_seconds: float = 120.0
    hold_seconds: float = 3600.0


class Routers(Protocol):
    """The router replicas' worker registries (the act step's second way out of rotation)."""

    def deregister(self, worker_url: str) -> list[str]:
        """Remove `worker_url` from every replica that lists it; returns what was done."""
        ...


@dataclass
class HttpRouters:
    """SGLang router replicas at `urls()` (e.g. http://<router pod IP>:8000), over HTTP."""

    urls: Callable[[], list[str]]
    timeout_seconds: float = 3.0

    def _json(self, method: str, url: str) -> Any:
        req = urllib.request.Request(url, method=method)
        with urllib.request.urlopen(req, timeout=self.timeout_seconds) as resp:  # http only
            return json.loads(resp.read() or b"null")

    def deregister(self, worker_url: str) -> list[str]:
        done = []
        for router in self.urls():
            try:
                listed = self._json("GET", f"{router}/workers").get("workers", [])
                for worker in listed:
                    if worker.get("url") == worker_url:
                        self._json("DELETE", f"{router}/workers/{worker['id']}")
                        done.append(f"{worker_url} removed from router {router}")
            except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
                done.append(f"router {router} unreachable: {exc}")  # retried next tick
        return done


def router_pod_urls(api: PodApi, namespace: str, name: str) -> Callable[[], list[str]]:
    """The resource's router replicas, found by their pods' labels."""

    def urls() -> list[str]:
        selector = {c.LABEL_NAME: name, c.LABEL_ROLE: c.ROLE_ROUTER}
        pods = api.list("Pod", namespace, selector)
        ips = [p.get("status", {}).get("podIP") for p in pods]
        return [f"http://{ip}:{c.ROUTER_PORT}" for ip in ips if ip]

    return urls


@dataclass
class LoopState:
    """What the caller keeps per custom resource between ticks (in memory only)."""

    guard: GuardState = field(default_factory=GuardState)
    pressure: PressureState = field(default_factory=PressureState)


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
    scale: ScaleOutcome | None = None  # P:D hint, when the caller passed pool counts
    views: list[PodView] = field(default_factory=list)  # the pods left, with their signals


# --- reading pods ---------------------------------------------------------------------------


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 annotation; None when absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _meta(pod: Manifest) -> dict[str, Any]:
    meta: dict[str, Any] = pod.get("metadata", {})
    return meta


def is_ready(pod: Manifest) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(cd.get("type") == "Ready" and cd.get("status") == "True" for cd in conditions)


def draining_since(pod: Manifest) -> float | None:
    return parse_time(_meta(pod).get("annotations", {}).get(ANNOTATION_DRAINING_SINCE))


def is_group_worker(pod: Manifest) -> bool:
    """A non-leader pod of a multi-node (LeaderWorkerSet) instance."""
    index = _meta(pod).get("labels", {}).get(c.LWS_WORKER_INDEX_LABEL)
    return index is not None and index != "0"


def engine_pods(api: PodApi, namespace: str, name: str) -> list[Manifest]:
    """This resource's engine instances, one pod each, not already being deleted.

    A multi-node instance is its leader pod: only the leader serves (the router knows only
    it) and exports the instance's metrics, so it is what is observed, judged and drained.
    Deleting it replaces the whole group (the LWS restart policy is RecreateGroupOnPodRestart),
    and holding it out of rotation holds the group; the worker pods are never touched here."""
    selector = {c.LABEL_NAME: name, c.LABEL_APP_NAME: c.APP_ENGINE}
    pods = api.list("Pod", namespace, selector)
    return [p for p in pods if not _meta(p).get("deletionTimestamp") and not is_group_worker(p)]


def target_of(pod: Manifest) -> PodTarget:
    meta = _meta(pod)
    return PodTarget(
        name=meta["name"],
        role=meta.get("labels", {}).get(c.LABEL_ROLE, ""),
        namespace=meta.get("namespace", ""),
        ip=pod.get("status", {}).get("podIP"),
        port=c.ENGINE_PORT,
    )


def view_of(pod: Manifest, signals: PodSignals | None) -> PodView:
    meta = _meta(pod)
    return PodView(
        name=meta["name"],
        role=meta.get("labels", {}).get(c.LABEL_ROLE, ""),
        ready=is_ready(pod),
        serving=meta.get("labels", {}).get(c.LABEL_SERVING) == "true",
        draining_since=draining_since(pod),
        signals=signals,
    )


# --- acting ---------------------------------------------------------------------------------


def start_drain(api: PodApi, pod: Manifest, reason: str, now: float) -> Event:
    """Take the pod out of rotation and record why and since when, in one merge patch."""
    meta = _meta(pod)
    api.patch(
        "Pod",
        meta["namespace"],
        meta["name"],
        {
            "metadata": {
                "labels": {c.LABEL_SERVING: None},
                "annotations": {
                    ANNOTATION_DRAINING_SINCE: rfc3339(now),
                    ANNOTATION_DRAIN_REASON: reason,
                    ANNOTATION_DRAIN_STATE: STATE_DRAINING,
                },
            }
        },
    )
    return ("Warning", "PodDraining", f"pod {meta['name']} out of rotation: {reason}")


def next_step(
    pod: Manifest, running: float | None, action: GuardAction, now: float, policy: DrainPolicy
) -> str:
    """What a draining pod needs now: "wait", "hold", "delete" or "none" (pure)."""
    since = draining_since(pod)
    if since is None:
        return "none"
    state = _meta(pod).get("annotations", {}).get(ANNOTATION_DRAIN_STATE, STATE_DRAINING)
    if state == STATE_HELD:
        return "delete" if now - since >= policy.hold_seconds else "none"
    if now - since < policy.min_wait_seconds:
        return "wait"
    if (running is None or running > 0) and now - since < policy.grace_seconds:
        return "wait"
    return "hold" if action == GuardAction.DRAIN else "delete"


def advance_drains(
    api: PodApi,
    pods: list[Manifest],
    observation: Observation,
    action: GuardAction,
    now: float,
    policy: DrainPolicy,
) -> tuple[list[Event], set[str]]:
    """Move every draining pod one step; returns events and the names deleted this tick."""
    events: list[Event] = []
    deleted: set[str] = set()
    for pod in pods:
        meta = _meta(pod)
        signals = observation.signals.get(meta["name"])
        running = signals.running if signals is not None and signals.error is None else None
        step = next_step(pod, running, action, now, policy)
        if step == "delete":
            api.delete("Pod", meta["namespace"], meta["name"])
            deleted.add(meta["name"])
            why = "held long enough" if _held(pod) else _drained_why(running)
            events.append(("Normal", "PodReplaced", f"pod {meta['name']} deleted ({why})"))
        elif step == "hold":
            patch = {"metadata": {"annotations": {ANNOTATION_DRAIN_STATE: STATE_HELD}}}
            api.patch("Pod", meta["namespace"], meta["name"], patch)
            meta.setdefault("annotations", {})[ANNOTATION_DRAIN_STATE] = STATE_HELD
            events.append(
                ("Normal", "PodHeld", f"pod {meta['name']} drained, held out of rotation")
            )
    return events, deleted


def _held(pod: Manifest) -> bool:
    return bool(_meta(pod).get("annotations", {}).get(ANNOTATION_DRAIN_STATE) == STATE_HELD)


def _drained_why(running: float | None) -> str:
    return "no running requests" if running == 0 else "grace period over"


def deregister_draining(pods: list[Manifest], routers: Routers) -> list[Event]:
    """Make sure no router replica still lists a draining pod (level-based, every tick)."""
    events: list[Event] = []
    for pod in pods:
        meta = _meta(pod)
        ip = pod.get("status", {}).get("podIP")
        if draining_since(pod) is None or not ip:
            continue
        for line in routers.deregister(f"http://{ip}:{c.ENGINE_PORT}"):
            kind = "Warning" if "unreachable" in line else "Normal"
            events.append((kind, "WorkerDeregistered" if kind == "Normal" else
                           "RouterUnreachable", f"pod {meta['name']}: {line}"))  # fmt: skip
    return events


def draining_status(pods: list[Manifest], observation: Observation) -> list[dict[str, Any]]:
    """`status.draining`: one entry per pod out of rotation by us, oldest first."""
    entries = []
    for pod in pods:
        meta = _meta(pod)
        ann = meta.get("annotations", {})
        if ANNOTATION_DRAINING_SINCE not in ann:
            continue
        signals = observation.signals.get(meta["name"])
        entry: dict[str, Any] = {
            "pod": meta["name"],
            "role": meta.get("labels", {}).get(c.LABEL_ROLE, ""),
            "reason": ann.get(ANNOTATION_DRAIN_REASON, ""),
            "since": ann[ANNOTATION_DRAINING_SINCE],
            "state": ann.get(ANNOTATION_DRAIN_STATE, STATE_DRAINING),
        }
        if signals is not None and signals.error is None and signals.running is not None:
            entry["runningRequests"] = int(signals.running)
        entries.append(entry)
    return sorted(entries, key=lambda e: (e["since"], e["pod"]))


# --- the tick ---------------------------------------------------------------------------


def guard_tick(
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
    counts: PoolCounts | None = None,
    bounds: ScaleBounds | None = None,
    routers: Routers | None = None,
) -> TickResult:
    """One observe -> decide -> act pass for one CodingAgentServing.

    Inputs: the API seam and metrics source, the resource's name/namespace, its parsed
    `spec.anomalyGuard`, the LoopState from the previous tick (mutated in place), and wall
    time `now` (epoch seconds; the drain annotations are wall-clock). Steps:
    1. list the engine pods; 2. observe them over `spec.window_seconds`;
    3. decide (pure); 4. start the drains it ordered (label off, annotations) and deregister
    every draining pod from every router replica (`routers`, default: the resource's router
    pods over HTTP); 5. advance drains in progress;
    6. report status.draining, the Degraded messages and per-pool anomaly rates;
    7. with `counts` (desired/ready instances per pool) and `bounds` (ratio.min/max/gpuBudget),
       also the P:D pressure hint (`TickResult.scale`); applying it is the caller's job.
    """
    drain_policy = drain_policy or DrainPolicy()
    pods = engine_pods(api, namespace, name)
    observation = source.observe([target_of(p) for p in pods], float(spec.window_seconds))
    events: list[Event] = []
    decision: AnomalyDecision | None = None
    if spec.enabled:
        views = [view_of(p, observation.signals.get(_meta(p)["name"])) for p in pods]
        decision = decide(spec, views, state.guard, now, policy)
        state.guard = decision.state
        events += decision.events
        by_name = {_meta(p)["name"]: p for p in pods}
        for order in decision.drains:
            events.append(start_drain(api, by_name[order.name], order.reason, now))
            _mark_draining(by_name[order.name], order.reason, now)
    routers = routers or HttpRouters(router_pod_urls(api, namespace, name))
    events += deregister_draining(pods, routers)
    stepped, deleted = advance_drains(api, pods, observation, spec.action, now, drain_policy)
    events += stepped
    remaining = [p for p in pods if _meta(p)["name"] not in deleted]
    views = [view_of(p, observation.signals.get(_meta(p)["name"])) for p in remaining]
    scale = None
    if counts is not None:
        scale = suggest_scale(views, counts, bounds or ScaleBounds(), state.pressure)
        state.pressure = scale.state
    return TickResult(
        events=events,
        draining=draining_status(remaining, observation),
        degraded=decision.degraded if decision else None,
        unavailable=(decision.unavailable if decision else None) or observation.error,
        pool_rate=decision.pool_rate if decision else {},
        decision=decision,
        scale=scale,
        views=views,
    )


def _mark_draining(pod: Manifest, reason: str, now: float) -> None:
    """Mirror start_drain's patch on our copy, so this tick's later steps see it."""
    meta = _meta(pod)
    meta.setdefault("labels", {}).pop(c.LABEL_SERVING, None)
    meta.setdefault("annotations", {}).update(
        {
            ANNOTATION_DRAINING_SINCE: rfc3339(now),
            ANNOTATION_DRAIN_REASON: reason,
            ANNOTATION_DRAIN_STATE: STATE_DRAINING,
        }
    )

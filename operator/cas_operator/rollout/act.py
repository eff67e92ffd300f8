"""Loop 4's act step: one tick of a Canary fleet's rollout, run by the fleet tick.

Entry point: `rollout_tick(api, source, resource, spec, previous, findings, now)`:
1. the state to move: the fleet tick's last one (`previous`), else the status's;
2. a user's action from the annotation `cas.dev/rollout-action` (promote, skip, abort,
   retry; `kubectl cas rollout ...` sets it), consumed once: the annotation is removed after
   the decision (the operator never writes the spec or labels; this key is its own);
3. while the canary has traffic, both revisions' engine and router pods are observed over the
   window since the weight took effect (at most `analysis.windowSeconds`) and compared
   (`rollout.analysis`);
4. `rollout.decide` moves the state; the fleet tick hands it to the passes (the one status
   writer), whose reconcile sizes pools and sets weights from it.
Ownership: `api` does the one write (the annotation), `source` all metrics I/O; the state is
kept by the caller in memory and by the status (a restarted operator resumes from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from cas_operator.api import constants as c
from cas_operator.api.models import CodingAgentServingSpec, RolloutStrategy
from cas_operator.observe.types import MetricsSource, PodTarget
from cas_operator.rollout.analysis import Analysis, MeasuredPod, RevisionMetrics, analyse
from cas_operator.rollout.decide import WINDOW_STEP_SECONDS, RolloutInputs, decide
from cas_operator.rollout.state import Action, RolloutState
from cas_operator.types import Event, Manifest, Status


class ResourceApi(Protocol):
    """The calls this module makes (`cas_operator.kube.Kube` satisfies it)."""

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest: ...


@dataclass(frozen=True)
class Findings:
    """What the anomaly loop found this tick, by revision."""

    fleet_anomaly: str | None = None  # the stable revision's fleet-wide incident
    canary_anomaly: str | None = None  # the canary's own pods


@dataclass(frozen=True)
class RolloutResult:
    state: RolloutState | None = None  # None: not a Canary fleet (or nothing to roll yet)
    events: list[Event] = field(default_factory=list)


def parse_action(value: str | None) -> tuple[Action | None, str | None]:
    """The action an annotation value asks for, or the reason it is not one."""
    if value is None:
        return None, None
    try:
        return Action(value.strip().lower()), None
    except ValueError:
        valid = ", ".join(a.value for a in Action)
        return None, f"{c.ANNOTATION_ROLLOUT_ACTION}={value!r} is not one of {valid}"


def analysis_window(state: RolloutState, spec: CodingAgentServingSpec, now: float) -> float | None:
    """Seconds of the window to analyse: since the weight took effect, in whole steps, at most
    `analysis.windowSeconds`; None while the canary has no traffic, or has had it for less
    than one step. A window reaching back before the weight took effect counted the canary's
    start: its routers answer their readiness probes 503 until their engines register, and a
    canary was aborted on those (routerErrors 3/32, all probe answers)."""
    if state.canary is None or state.weight <= 0 or state.step_started is None:
        return None
    since = max(0.0, now - state.step_started)
    if since < WINDOW_STEP_SECONDS:
        return None
    whole = math.floor(since / WINDOW_STEP_SECONDS) * WINDOW_STEP_SECONDS
    return float(min(spec.rollout.analysis.window_seconds, whole))


def measure(
    api: ResourceApi,
    source: MetricsSource,
    resource: Manifest,
    revisions: tuple[str, str],
    window: float,
) -> tuple[RevisionMetrics, RevisionMetrics]:
    """Both revisions' engine and router pods over `window` (stable, canary)."""
    meta = resource["metadata"]
    selector = {c.LABEL_NAME: str(meta["name"]), c.LABEL_MANAGED_BY: c.MANAGED_BY}
    pods = [
        p
        for p in api.list("Pod", str(meta["namespace"]), selector)
        if p["metadata"].get("labels", {}).get(c.LABEL_REVISION) in revisions
        and not p["metadata"].get("deletionTimestamp")
    ]
    targets = [PodTarget.of(p) for p in pods]
    observation = source.observe(targets, window)
    by_revision: dict[str, list[MeasuredPod]] = {r: [] for r in revisions}
    for pod, target in zip(pods, targets, strict=True):
        revision = pod["metadata"]["labels"][c.LABEL_REVISION]
        signals = observation.signals.get(target.name)
        by_revision[revision].append(MeasuredPod(target.name, target.role, signals))
    stable, canary = (RevisionMetrics.of(r, by_revision[r]) for r in revisions)
    return stable, canary


def _ready_step(status: Status, canary: str | None) -> int | None:
    found = (status.get("rollout") or {}).get("canary") or {}
    if canary is None or found.get("revision") != canary:
        return None
    step = found.get("readyStep")
    return int(step) if step is not None else None


def rollout_tick(
    api: ResourceApi,
    source: MetricsSource,
    resource: Manifest,
    spec: CodingAgentServingSpec,
    previous: RolloutState | None,
    findings: Findings,
    now: float,
) -> RolloutResult:
    """One tick (see the module docstring)."""
    meta = resource["metadata"]
    asked = (meta.get("annotations") or {}).get(c.ANNOTATION_ROLLOUT_ACTION)
    if spec.rollout.strategy != RolloutStrategy.CANARY:
        if asked is None:
            return RolloutResult()
        consume(api, meta)
        why = f"{c.ANNOTATION_ROLLOUT_ACTION}={asked!r}: rollout.strategy is not Canary"
        return RolloutResult(events=[("Warning", "RolloutActionRefused", why)])
    status: Status = dict(resource.get("status") or {})
    revision = status.get("revision")
    if not revision:
        return RolloutResult()
    state = previous or RolloutState.recorded(status)
    action, refused = parse_action(asked)
    adopted = state.adopt(str(revision))
    analysis: Analysis | None = None
    window = analysis_window(adopted, spec, now)
    if window is not None and adopted.stable is not None and adopted.canary is not None:
        stable, canary = measure(api, source, resource, (adopted.stable, adopted.canary), window)
        analysis = analyse(
            canary,
            stable,
            spec.rollout.analysis,
            window_seconds=window,
            trip_floor=spec.anomaly_guard.pod_anomaly_rate_threshold,
            quality_gate=spec.engine.speculative is not None,
        )
    inputs = RolloutInputs(
        revision=str(revision),
        ready_step=_ready_step(status, adopted.canary),
        analysis=analysis,
        fleet_anomaly=findings.fleet_anomaly,
        canary_anomaly=findings.canary_anomaly,
        action=action,
    )
    decision = decide(state, spec.rollout, inputs, now)
    events = list(decision.events)
    if asked is not None:
        consume(api, meta)
        events.append(
            ("Warning", "RolloutActionRefused", refused)
            if refused
            else ("Normal", "RolloutAction", f"{action} taken: {decision.state.reason}")
        )
    return RolloutResult(decision.state, events)


def consume(api: ResourceApi, meta: Manifest) -> None:
    """Remove the action annotation once acted on (or refused): it is asked once."""
    gone = {"metadata": {"annotations": {c.ANNOTATION_ROLLOUT_ACTION: None}}}
    api.patch(c.KIND, str(meta["namespace"]), str(meta["name"]), gone)


def canary_of(
    spec: CodingAgentServingSpec, state: RolloutState | None, status: Status
) -> str | None:
    """The revision a Canary fleet runs as its canary now (the anomaly loop judges its pods
    apart); None for a Rolling fleet or without a canary."""
    if spec.rollout.strategy != RolloutStrategy.CANARY or not status.get("revision"):
        return None
    return (state or RolloutState.recorded(status)).adopt(str(status["revision"])).canary


def stable_pools(status: Status) -> dict[str, int] | None:
    """The stable revision's desired pool sizes during a canary (the anomaly loop's circuit
    breaker counts against them), None without one."""
    stable = (status.get("rollout") or {}).get("stable") or {}
    counts = {
        role: int(found["replicas"])
        for role in c.POOL_ROLES
        if (found := stable.get(role)) and "replicas" in found
    }
    return counts or None

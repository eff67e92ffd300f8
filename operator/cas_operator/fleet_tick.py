"""The fleet tick: every few seconds, loops 2-4 (anomaly, autoscale, rollout) over every resource.

Data flow (every `interval` seconds, started by handlers.py at operator start-up):
the latest copy of every CodingAgentServing (kopf's watch-fed `serving_index`)
-> one LIST of the pods of any CodingAgentServing, per namespace (`PodSnapshot`)
-> one metrics observation of every resource's engine and router pods per window (`prefetch`)
-> per resource, `workers` at a time:
   1. the anomaly loop: `anomaly.act.anomaly_tick` over its share of that observation (decide,
      act: drain label/annotations, router deregistration, deletes go straight to the API);
   2. the autoscale loop: `autoscale.loop.Autoscaler.step` over the pods it left and the
      routers (the pressure hint; the routers' refusals, which status.admission shows; in
      Recommend/Auto the measured load; in Auto one damped replica step);
   3. the scale-down loop: `scaledown.act.scale_down_tick` over the same pods, against the
      counts the last pass wrote (retire marks, releases; how far each workload may shrink);
   4. the rollout loop (Canary fleets): `rollout.act.rollout_tick` analyses the canary against
      the stable revision and moves the rollout (status.rollout); the anomaly loop judged the
      canary's pods apart and its finding is one of the rollout's inputs;
   5. the findings as one `reconcile.core.Measured` (status.anomaly, status.draining,
      status.autoscaler, the load, Auto's counts, the rollout), handed to the passes in memory
      (`measured_for`); when it changed, `on_change` asks for a pass.
The passes are the one writer of a resource's status: a condition and its evidence
(`Degraded: FleetWideAnomaly` and `status.anomaly.fleetWide`) land in the same write.
One loop instead of a kopf timer per resource: at N = 200 resources the per-resource timers
made 20 pod LISTs a second and queued behind each other in kopf's executor.
Ownership: `FleetTick.states` (anomaly LoopState per uid, memory only: drains resume from pod
annotations), `FleetTick.autoscaler` and `FleetTick.measured` (per uid; the status the passes
write is their durable copy); the snapshot answers reads for one tick only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from cas_operator.anomaly.act import LoopState, TickResult, anomaly_tick, engine_pods
from cas_operator.anomaly.detect import GuardState
from cas_operator.anomaly.drain import view_of
from cas_operator.api import constants as c
from cas_operator.api.models import CodingAgentServingSpec, parse_spec
from cas_operator.autoscale.controller import STATUS_KEY, ScaleOutcome
from cas_operator.autoscale.loop import Autoscaler, AutoscaleResult, PlanNumbers
from cas_operator.autoscale.model import ObservedSignals
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources.security import keys_secret_name
from cas_operator.kube import Kube
from cas_operator.observe.types import MetricsSource, Observation, PodSignals, PodTarget, PodView
from cas_operator.reconcile.core import Measured
from cas_operator.rollout.act import Findings, canary_of, rollout_tick, stable_pools
from cas_operator.routers import HttpRouters, control_plane_key, router_endpoints
from cas_operator.scaledown.act import ScaleDownResult, scale_down_tick
from cas_operator.types import Event, Manifest, Status

log = logging.getLogger(__name__)


def _matches(obj: Manifest, selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass
class PodSnapshot:
    """Pods of one tick, read once per namespace; writes pass through to the API client.

    Satisfies `anomaly.act.PodApi`, so `anomaly_tick` reads its engine and router pods from here."""

    kube: Kube
    pods: dict[str, list[Manifest]]

    @classmethod
    def take(cls, kube: Kube, namespaces: Iterable[str]) -> PodSnapshot:
        return cls(
            kube, {ns: kube.list_labelled("Pod", ns, c.LABEL_NAME, slim_pod) for ns in namespaces}
        )

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        if kind != "Pod" or namespace not in self.pods:
            return self.kube.list(kind, namespace, selector)
        return [p for p in self.pods[namespace] if _matches(p, selector)]

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        return self.kube.patch(kind, namespace, name, patch)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.kube.delete(kind, namespace, name)

    def evict(self, namespace: str, name: str, uid: str | None) -> bool:
        return self.kube.evict(namespace, name, uid)


@dataclass
class Prefetched:
    """A `MetricsSource` answering from one batched observation per window (taken once per
    tick for every resource's engine pods): the source is asked once per tick and window, not
    once per resource (at N=200 with Prometheus that was ~2,400 queries per tick; now 15 per
    namespace). Pods outside the batch, or a batch that failed, read as unavailable."""

    batches: dict[float, Observation]

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation:
        batch = self.batches.get(window_seconds)
        if batch is None:
            return Observation.outage(targets, "not measured this tick")
        if batch.error is not None:
            return Observation.outage(targets, batch.error)
        missing = PodSignals(error="not measured this tick")
        return Observation({t.name: batch.signals.get(t.name, missing) for t in targets})


def prefetch(
    source: MetricsSource,
    snapshot: PodSnapshot,
    specs: list[tuple[Manifest, CodingAgentServingSpec]],
) -> Prefetched:
    """Observe every resource's engine and router pods in one call per window (see
    `Prefetched`)."""
    by_window: dict[float, dict[tuple[str, str], PodTarget]] = {}
    for resource, spec in specs:
        meta = resource["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        pods = engine_pods(snapshot, namespace, name)
        window = by_window.setdefault(float(spec.anomaly_guard.window_seconds), {})
        for pod in [*pods, *router_pods(snapshot, namespace, name)]:
            target = PodTarget.of(pod)
            window[(target.namespace, target.name)] = target
    return Prefetched({w: source.observe(list(t.values()), w) for w, t in by_window.items()})


POD_METADATA_KEPT = (
    "name",
    "namespace",
    "uid",
    "labels",
    "annotations",
    "creationTimestamp",
    "deletionTimestamp",
)

POD_STATUS_KEPT = ("podIP", "phase", "conditions")


def router_pods(pods: PodSnapshot, namespace: str, name: str) -> list[Manifest]:
    """The resource's router pods (every revision's), not already being deleted."""
    selector = {c.LABEL_NAME: name, c.LABEL_ROLE: c.ROLE_ROUTER}
    return [
        p
        for p in pods.list("Pod", namespace, selector)
        if not p["metadata"].get("deletionTimestamp")
    ]


def router_views(
    source: MetricsSource, pods: PodSnapshot, namespace: str, name: str, window: float
) -> list[PodView]:
    """The resource's router pods with their signals (their answers and 429s)."""
    found = router_pods(pods, namespace, name)
    observed = source.observe([PodTarget.of(p) for p in found], window)
    return [view_of(p, observed.signals.get(p["metadata"]["name"])) for p in found]


def fleet_routers(
    kube: Kube, pods: PodSnapshot, name: str, namespace: str, spec: CodingAgentServingSpec
) -> HttpRouters:
    """The resource's router replicas (from this tick's pods) with its control-plane key."""
    secret = keys_secret_name(name, spec.security)
    endpoints = router_endpoints(pods, namespace, name, secret)
    return HttpRouters(endpoints, key_in=control_plane_key(kube, namespace))


def slim_pod(pod: Manifest) -> Manifest:
    """The fields the anomaly loop and Auto read (a pod's spec and managedFields are most of
    its size; at N=200 the whole list was tens of MiB per tick)."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    return {
        "metadata": {k: meta[k] for k in POD_METADATA_KEPT if k in meta},
        "status": {k: status[k] for k in POD_STATUS_KEPT if k in status},
    }


def _parsed(resource: Manifest) -> CodingAgentServingSpec | None:
    """The resource's spec, or None when invalid (the spec handlers report it)."""
    try:
        return parse_spec(dict(resource.get("spec", {})))
    except ValidationError:
        return None


def desired_counts(status: Status) -> dict[str, int]:
    """Each pool's desired instance count, as the last pass wrote it."""
    pools = ((role, status.get(role)) for role in c.POOL_ROLES)
    return {role: int(pool["replicas"]) for role, pool in pools if pool and "replicas" in pool}


def anomaly_status(result: TickResult, scale: ScaleOutcome | None, guard: GuardState) -> Status:
    """`status.anomaly` and `status.draining` from one tick (the conditions derive from them)."""
    rates = {role: rate for role, rate in result.pool_rate.items() if rate is not None}
    worst = max(rates.values(), default=None)
    anomaly: dict[str, Any] = {
        "rate": f"{worst:.3%}" if worst is not None else "n/a",
        "pools": {role: round(rate, 6) for role, rate in rates.items()},
        "fleetWide": result.degraded,
        "signalUnavailable": result.unavailable,
        **guard.drain_record(),
    }
    if scale is not None:
        hint = scale.hint
        anomaly["pressure"] = {
            "note": scale.note,
            "suggested": f"{hint.prefill}:{hint.decode}" if hint else None,
        }
    return {"anomaly": anomaly, "draining": result.draining}


@dataclass
class FleetTick:
    """One tick over every resource; see the module docstring.

    `post(body, event)` publishes one event on a resource (`Kube.post_event` in the operator).
    """

    kube: Kube
    source: Callable[[], MetricsSource]
    post: Callable[[Manifest, Event], None]
    workers: int = 4
    on_change: Callable[[Manifest], None] = lambda resource: None
    states: dict[str, LoopState] = field(default_factory=dict)
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    measured: dict[str, Measured] = field(default_factory=dict)
    last_tick_seconds: float = 0.0

    def measured_for(self, uid: str, status: Status) -> Measured:
        """This process's latest measurement of a resource, else what its status kept (a
        restarted operator keeps Auto's replicas instead of jumping back to the planner's)."""
        found = self.measured.get(uid)
        if found is not None:
            return found
        return Measured.kept_in(status)

    def tick(self, resources: list[Manifest], now: float | None = None) -> int:
        """Run both loops for every resource once; returns how many findings changed (each
        of which asked for a pass)."""
        started = time.monotonic()
        now = time.time() if now is None else now
        namespaces = {str(r["metadata"]["namespace"]) for r in resources}
        snapshot = PodSnapshot.take(self.kube, sorted(namespaces))
        specs = [(r, spec) for r in resources if (spec := _parsed(r)) is not None]
        source = prefetch(self.source(), snapshot, specs)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="tick") as pool:
            changed = sum(
                pool.map(lambda rs: self._tick_one(snapshot, source, rs[0], rs[1], now), specs)
            )
        live = {str(r["metadata"]["uid"]) for r in resources}
        for states in (self.states, self.measured):
            for uid in set(states) - live:  # deleted resources
                del states[uid]
        self.autoscaler.forget(live)
        self.last_tick_seconds = time.monotonic() - started
        return changed

    def _tick_one(
        self,
        snapshot: PodSnapshot,
        source: MetricsSource,
        resource: Manifest,
        spec: CodingAgentServingSpec,
        now: float,
    ) -> int:
        meta = resource["metadata"]
        uid, name, namespace = str(meta["uid"]), str(meta["name"]), str(meta["namespace"])
        current = dict(resource.get("status") or {})
        try:
            if uid not in self.states:  # a restarted operator keeps its drain record
                self.states[uid] = LoopState(GuardState.restored(current.get("anomaly")))
            before = self.measured_for(uid, current)
            canary = canary_of(spec, before.rollout, current)
            result = anomaly_tick(
                snapshot,
                source,
                name=name,
                namespace=namespace,
                spec=spec.anomaly_guard,
                state=self.states[uid],
                now=now,
                desired=stable_pools(current) or desired_counts(current),
                routers=fleet_routers(self.kube, snapshot, name, namespace, spec),
                canary=canary,
            )
            engine = {c.LABEL_NAME: name, c.LABEL_APP_NAME: c.APP_ENGINE}
            window = float(spec.anomaly_guard.window_seconds)
            routers = router_views(source, snapshot, namespace, name, window)
            scaled = self.autoscaler.step(
                uid,
                spec,
                result.views + routers,
                lambda: snapshot.list("Pod", namespace, engine),
                current,
                plan_numbers(name, namespace, spec, before),
                now,
                canary=canary,
            )
            retired = scale_down_tick(
                snapshot,
                result.pods,
                {view.name: view.signals for view in result.views},
                current,
                float(spec.engine.drain_seconds),
                now,
            )
            rolled = rollout_tick(
                snapshot,
                self.source(),
                resource,
                spec,
                before.rollout,
                Findings(result.degraded, result.canary_anomaly),
                now,
            )
            measured = measured_from(result, scaled, retired, self.states[uid].guard)
            measured = replace(measured, rollout=rolled.state)
            self.measured[uid] = measured
        except Exception:  # one resource's failure must not stop the others' tick
            log.exception("fleet tick of %s/%s failed", namespace, name)
            return 0
        if measured != before:
            # The reconcile folds these into the pools and conditions and writes them with
            # its status: hand them over in memory and ask for a pass.
            self.on_change(resource)
        self._post(resource, result.events + retired.events + rolled.events)
        return 1 if measured != before else 0

    def _post(self, resource: Manifest, events: list[Event]) -> None:
        """Events after the findings are handed over (a failed post must not cost them)."""
        for event in events:
            try:
                self.post(resource, event)
            except Exception:
                log.exception("event %s on %s not posted", event[1], resource["metadata"]["name"])


def measured_from(
    result: TickResult, scaled: AutoscaleResult, retired: ScaleDownResult, guard: GuardState
) -> Measured:
    """One resource's findings of this tick, as the passes write them."""
    sections = anomaly_status(result, scaled.scale, guard)
    if scaled.entry is not None:
        sections[STATUS_KEY] = scaled.entry
    return Measured(
        observed=scaled.observed,
        auto_replicas=scaled.auto_replicas,
        sections=sections,
        floors=retired.floors,
        older=retired.older,
    )


def plan_numbers(
    name: str, namespace: str, spec: CodingAgentServingSpec, before: Measured
) -> Callable[[ObservedSignals], PlanNumbers | None]:
    """Plans the resource for a measured load (Auto's slow loop); None when it cannot."""

    def plan(observed: ObservedSignals) -> PlanNumbers | None:
        try:
            p = build_plan(name, namespace, spec, observed, before.auto_replicas)
        except InvalidSpec:
            return None  # the reconcile reports it
        rec = p.recommendation
        planned = (rec.prefill, rec.decode) if rec and rec.prefill and rec.decode else None
        return PlanNumbers(
            replicas=(p.prefill.replicas, p.decode.replicas),
            planned=planned,
            prefill_gpus=p.prefill.shape.gpus,
            decode_gpus=p.decode.shape.gpus,
            prefill_nodes=p.prefill.shape.nodes,
            decode_nodes=p.decode.shape.nodes,
        )

    return plan

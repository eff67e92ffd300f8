"""The anomaly loop for the whole fleet: one pod LIST per namespace per tick, then one
`drain.guard_tick` per resource over that snapshot.

Data flow (every `interval` seconds, started by handlers.py at operator start-up):
the latest copy of every CodingAgentServing (kopf's watch-fed `serving_index`)
-> one LIST of the pods of any CodingAgentServing, per namespace (`PodSnapshot`)
-> one metrics observation of every resource's engine pods per window (`prefetch`)
-> per resource, `guard_workers` at a time: `guard_tick` (its pods' share of that observation,
   decide, act: drain label/annotations, router deregistration, deletes go straight to the API)
-> for `ratio.mode` Recommend/Auto: the measured load (`autoscale.observed_signals`) and, in
   Auto, one damped replica step (`autoscale.auto_step`), kept in memory (`measured`) for the
   reconcile passes, which are asked to run (`on_change`) when the answer changed
-> a merge patch of `status.anomaly` / `status.draining` / `status.autoscaler` when they
   changed, and the events.
One loop instead of a kopf timer per resource: at N = 200 resources the per-resource timers
made 20 pod LISTs a second and queued behind each other in kopf's executor.
Ownership: `FleetGuard.states` (LoopState per resource uid, memory only: drains resume from
pod annotations) and `FleetGuard.measured` (per uid; status.autoscaler is its durable copy);
the snapshot answers reads for one tick only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cas_operator.api import constants as c
from cas_operator.api.models import CodingAgentServingSpec, RatioMode, parse_spec
from cas_operator.drain import (
    Event,
    LoopState,
    TickResult,
    engine_pods,
    guard_tick,
    parse_time,
    target_of,
)
from cas_operator.kube import Kube
from cas_operator.observe.types import MetricsSource, Observation, PodTarget
from cas_operator.planning import autoscale
from cas_operator.planning.anomaly import PodSignals, PoolCounts, ScaleBounds
from cas_operator.planning.autoscale import AutoState
from cas_operator.planning.plan import InvalidSpec, build_plan
from cas_operator.planning.ratio import ControlState, ObservedSignals, SloInputs
from cas_operator.reconcile import Measured

log = logging.getLogger(__name__)
RESYNC_SECONDS = 120.0  # how long the guard trusts its own last write over the object's copy
Manifest = dict[str, Any]
Status = dict[str, Any]


def _matches(obj: Manifest, selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass
class PodSnapshot:
    """Pods of one tick, read once per namespace; writes pass through to the API client.

    Satisfies `drain.PodApi`, so `guard_tick` reads its engine and router pods from here."""

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


@dataclass
class Prefetched:
    """A `MetricsSource` answering from one batched observation per window (taken once per
    tick for every resource's engine pods): the source is asked once per tick and window, not
    once per resource (at N=200 with Prometheus that was ~2,400 queries per tick; now 12 per
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
    """Observe every resource's engine pods in one call per window (see `Prefetched`)."""
    by_window: dict[float, dict[tuple[str, str], PodTarget]] = {}
    for resource, spec in specs:
        meta = resource["metadata"]
        pods = engine_pods(snapshot, str(meta["namespace"]), str(meta["name"]))
        window = by_window.setdefault(float(spec.anomaly_guard.window_seconds), {})
        for target in map(target_of, pods):
            window[(target.namespace, target.name)] = target
    return Prefetched({w: source.observe(list(t.values()), w) for w, t in by_window.items()})


POD_METADATA_KEPT = ("name", "namespace", "uid", "labels", "annotations",
                     "creationTimestamp", "deletionTimestamp")  # fmt: skip
POD_STATUS_KEPT = ("podIP", "phase", "conditions")


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


def pool_counts(status: Status) -> PoolCounts | None:
    """Desired and ready instances per pool from our own status (None before the first pass)."""
    prefill, decode = status.get("prefill"), status.get("decode")
    if not prefill or not decode:
        return None
    return PoolCounts(
        prefill=int(prefill["replicas"]),
        decode=int(decode["replicas"]),
        prefill_ready=int(prefill.get("readyReplicas", 0)),
        decode_ready=int(decode.get("readyReplicas", 0)),
        prefill_gpus=int(prefill.get("gpusPerInstance", 1)),
        decode_gpus=int(decode.get("gpusPerInstance", 1)),
    )


def anomaly_status(result: TickResult) -> Status:
    """`status.anomaly` and `status.draining` from one tick (the conditions derive from them)."""
    rates = {role: rate for role, rate in result.pool_rate.items() if rate is not None}
    worst = max(rates.values(), default=None)
    anomaly: dict[str, Any] = {
        "rate": f"{worst:.3%}" if worst is not None else "n/a",
        "pools": {role: round(rate, 6) for role, rate in rates.items()},
        "fleetWide": result.degraded,
        "signalUnavailable": result.unavailable,
    }
    if result.scale is not None:
        hint = result.scale.hint
        anomaly["pressure"] = {
            "note": result.scale.note,
            "suggested": f"{hint.prefill}:{hint.decode}" if hint else None,
        }
    return {"anomaly": anomaly, "draining": result.draining}


def status_changes(current: Status, desired: Status) -> Status:
    """The keys of `desired` whose value differs from the resource's current status."""
    return {k: v for k, v in desired.items() if current.get(k) != v}


@dataclass
class Written:
    """What the guard last wrote to one resource's status, and when (monotonic)."""

    status: Status
    at: float


@dataclass
class FleetGuard:
    """One tick over every resource; see the module docstring.

    `post(body, event)` publishes one event on a resource (`Kube.post_event` in the operator:
    this runs outside kopf's handlers, where `kopf.event` has no queue)."""

    kube: Kube
    source: Callable[[], MetricsSource]
    post: Callable[[Manifest, Event], None]
    guard_workers: int = 4
    on_change: Callable[[Manifest], None] = lambda resource: None
    states: dict[str, LoopState] = field(default_factory=dict)
    measured: dict[str, Measured] = field(default_factory=dict)
    auto_states: dict[str, AutoState] = field(default_factory=dict)
    # The diff baseline: the status copy in a resource event lags our own writes under load
    # (measured at N=200: a rewrite of the same anomaly status on nearly every tick), so the
    # guard compares with what it wrote, and with the object only after RESYNC_SECONDS (which
    # repairs a status someone else changed).
    written: dict[str, Written] = field(default_factory=dict)
    last_tick_seconds: float = 0.0

    def measured_for(self, uid: str, status: Status) -> Measured:
        """This process's latest measurement of a resource, else what status.autoscaler kept
        (a restarted operator keeps Auto's replicas instead of jumping back to the planner's)."""
        found = self.measured.get(uid)
        if found is not None:
            return found
        state = AutoState.from_status(status.get(autoscale.STATUS_KEY))
        return Measured(auto_replicas=state.replicas if state else None,
                        anomaly=status.get("anomaly"))  # fmt: skip

    def tick(self, resources: list[Manifest], now: float | None = None) -> int:
        """Guard every resource once; returns how many status patches were written."""
        started = time.monotonic()
        now = time.time() if now is None else now
        namespaces = {str(r["metadata"]["namespace"]) for r in resources}
        snapshot = PodSnapshot.take(self.kube, sorted(namespaces))
        specs = [(r, spec) for r in resources if (spec := _parsed(r)) is not None]
        source = prefetch(self.source(), snapshot, specs)
        with ThreadPoolExecutor(self.guard_workers, thread_name_prefix="guard") as pool:
            written = sum(
                pool.map(lambda rs: self._guard_one(snapshot, source, rs[0], rs[1], now), specs)
            )
        live = {str(r["metadata"]["uid"]) for r in resources}
        for uid in set(self.states) - live:  # deleted resources
            del self.states[uid]
        for uid in set(self.measured) - live:
            del self.measured[uid]
        for uid in set(self.auto_states) - live:
            del self.auto_states[uid]
        for uid in set(self.written) - live:
            del self.written[uid]
        self.last_tick_seconds = time.monotonic() - started
        return written

    def _guard_one(
        self,
        snapshot: PodSnapshot,
        source: MetricsSource,
        resource: Manifest,
        parsed: CodingAgentServingSpec,
        now: float,
    ) -> int:
        meta = resource["metadata"]
        current = dict(resource.get("status") or {})
        try:
            result = guard_tick(
                snapshot,
                source,
                name=str(meta["name"]),
                namespace=str(meta["namespace"]),
                spec=parsed.anomaly_guard,
                state=self.states.setdefault(str(meta["uid"]), LoopState()),
                now=now,
                counts=pool_counts(current),
                bounds=ScaleBounds(parsed.ratio.min, parsed.ratio.max, parsed.ratio.gpu_budget),
            )
            desired = anomaly_status(result)
            uid = str(meta["uid"])
            before = self.measured_for(uid, current)
            entry, observed, auto = self._autoscale(snapshot, resource, parsed, result, before, now)
            desired.update(entry)
            # The reconcile folds these into the pools and conditions: hand them over in memory
            # (the status copy a pass reads may predate this write) and ask for a pass.
            self.measured[uid] = Measured(observed, auto, desired["anomaly"])
            if self.measured[uid] != before:
                self.on_change(resource)
            changes = self._changes(uid, current, desired)
            if changes:
                self.kube.patch_status(c.KIND, str(meta["namespace"]), str(meta["name"]), changes)
                self.written[uid] = Written(desired, time.monotonic())
        except Exception:  # one resource's failure must not stop the others' guard
            log.exception("anomaly tick of %s/%s failed", meta["namespace"], meta["name"])
            return 0
        self._post(resource, result.events)
        return 1 if changes else 0

    def _changes(self, uid: str, current: Status, desired: Status) -> Status:
        """What to write: against our last write while it is recent, else the object."""
        last = self.written.get(uid)
        if last is not None and time.monotonic() - last.at < RESYNC_SECONDS:
            return status_changes(last.status, desired)
        return status_changes(current, desired)

    def _post(self, resource: Manifest, events: list[Event]) -> None:
        """Events after the status (a failed post must not cost the status write)."""
        for event in events:
            try:
                self.post(resource, event)
            except Exception:
                log.exception("event %s on %s not posted", event[1], resource["metadata"]["name"])

    def _autoscale(
        self,
        snapshot: PodSnapshot,
        resource: Manifest,
        spec: CodingAgentServingSpec,
        result: TickResult,
        before: Measured,
        now: float,
    ) -> tuple[Status, ObservedSignals | None, tuple[int, int] | None]:
        """Recommend/Auto: measure the load, in Auto take one replica step; returns the
        `status.autoscaler` entry ({} in Fixed mode), the measured load and Auto's counts."""
        uid = str(resource["metadata"]["uid"])
        if spec.ratio.mode == RatioMode.FIXED:
            self.auto_states.pop(uid, None)
            return {}, None, None
        observed = autoscale.quantized(
            autoscale.observed_signals(result.views, float(spec.anomaly_guard.window_seconds))
        )
        entry: Status = {"observed": observed_status(observed)}
        if spec.ratio.mode != RatioMode.AUTO:
            self.auto_states.pop(uid, None)
            return {autoscale.STATUS_KEY: entry}, observed, None
        auto = before.auto_replicas
        state = self._auto_step(snapshot, resource, spec, result, observed, before, now)
        if state is not None:
            auto = state.replicas
            entry.update(state.to_status())
        return {autoscale.STATUS_KEY: entry}, observed, auto

    def _auto_step(
        self,
        snapshot: PodSnapshot,
        resource: Manifest,
        spec: CodingAgentServingSpec,
        result: TickResult,
        observed: ObservedSignals,
        before: Measured,
        now: float,
    ) -> AutoState | None:
        meta = resource["metadata"]
        status = dict(resource.get("status") or {})
        try:
            plan = build_plan(str(meta["name"]), str(meta["namespace"]), spec, observed,
                              before.auto_replicas)  # fmt: skip
        except InvalidSpec:
            return None  # the reconcile reports it
        uid = str(meta["uid"])
        current = self.auto_states.get(uid) or AutoState.from_status(
            status.get(autoscale.STATUS_KEY)
        )
        if current is None or current.replicas != (plan.prefill.replicas, plan.decode.replicas):
            current = AutoState(plan.prefill.replicas, plan.decode.replicas,
                                current.control if current else ControlState())  # fmt: skip
        rec = plan.recommendation
        planned = (rec.prefill, rec.decode) if rec and rec.prefill and rec.decode else None
        engine = {c.LABEL_NAME: str(meta["name"]), c.LABEL_APP_NAME: c.APP_ENGINE}
        pods = snapshot.list("Pod", str(meta["namespace"]), engine)
        inputs = autoscale.AutoInputs(
            current=current,
            prefill_pods=instances(pods, c.ROLE_PREFILL, plan.prefill.shape.nodes),
            decode_pods=instances(pods, c.ROLE_DECODE, plan.decode.shape.nodes),
            prefill_gpus=plan.prefill.shape.gpus,
            decode_gpus=plan.decode.shape.gpus,
            slo=SloInputs(ttft_s=spec.slo.ttft_seconds, itl_ms=spec.slo.itl_milliseconds),
            ratio_min=spec.ratio.min,
            ratio_max=spec.ratio.max,
            gpu_budget=spec.ratio.gpu_budget,
            pod_start_s=pod_start_seconds(pods),
            down_stable_s=spec.ratio.scale_down_stabilization_seconds,
            rebalance_stable_s=spec.ratio.rebalance_stabilization_seconds,
        )
        hint = result.scale.hint if result.scale is not None else None
        state = autoscale.auto_step(inputs, planned or current.replicas, observed, hint, now)
        self.auto_states[uid] = state
        return state


def instances(pods: list[Manifest], role: str, pods_per_instance: int) -> int:
    """Instances of one role that still hold GPUs (terminating pods included)."""
    count = sum(1 for p in pods if p["metadata"].get("labels", {}).get(c.LABEL_ROLE) == role)
    return -(-count // max(1, pods_per_instance))


def pod_start_seconds(pods: list[Manifest]) -> float:
    """p90 of creation -> Ready over the resource's pods that became Ready (the autoscaler's
    cooldown is at least this); the default until one has been seen."""
    starts = []
    for pod in pods:
        created = parse_time(pod["metadata"].get("creationTimestamp"))
        for cond in pod.get("status", {}).get("conditions", []):
            ready_at = parse_time(cond.get("lastTransitionTime"))
            ready = cond.get("type") == "Ready" and cond.get("status") == "True"
            if ready and ready_at is not None and created is not None:
                starts.append(max(1.0, ready_at - created))
    if not starts:
        return autoscale.DEFAULT_POD_START_SECONDS
    starts.sort()
    return starts[min(len(starts) - 1, int(0.9 * len(starts)))]


def observed_status(o: ObservedSignals) -> Status:
    """The measured load as status shows it (None fields left out)."""
    fields = {
        "arrivalRate": o.arrival_rate,
        "hitRate": o.hit_rate,
        "prefillQueue": o.prefill_queue_depth,
        "decodeKvUsage": o.decode_kv_usage,
        "decodeQueue": o.decode_queue_depth,
        "ttftP90Seconds": o.ttft_p90_s,
        "abortsPerSecond": o.aborts_per_s,
    }
    return {k: v for k, v in fields.items() if v is not None}

"""The anomaly loop for the whole fleet: one pod LIST per namespace per tick, then one
`drain.guard_tick` per resource over that snapshot.

Data flow (every `interval` seconds, started by handlers.py at operator start-up):
the latest copy of every CodingAgentServing (kopf's watch-fed `serving_index`)
-> one LIST of the pods of any CodingAgentServing, per namespace (`PodSnapshot`)
-> per resource, `guard_workers` at a time: `guard_tick` (observe its pods' metrics, decide,
   act: drain label/annotations, router deregistration, deletes go straight to the API)
-> a merge patch of `status.anomaly` / `status.draining` when they changed, and the events.
One loop instead of a kopf timer per resource: at N = 200 resources the per-resource timers
made 20 pod LISTs a second and queued behind each other in kopf's executor.
Ownership: `FleetGuard.states` (LoopState per resource uid, memory only: drains resume from
pod annotations); the snapshot answers reads for one tick only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cas_operator.api import constants as c
from cas_operator.api.models import parse_spec
from cas_operator.drain import Event, LoopState, TickResult, guard_tick
from cas_operator.kube import Kube
from cas_operator.observe.types import MetricsSource
from cas_operator.planning.anomaly import PoolCounts, ScaleBounds

log = logging.getLogger(__name__)
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
        return cls(kube, {ns: kube.list_labelled("Pod", ns, c.LABEL_NAME) for ns in namespaces})

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        if kind != "Pod" or namespace not in self.pods:
            return self.kube.list(kind, namespace, selector)
        return [p for p in self.pods[namespace] if _matches(p, selector)]

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        return self.kube.patch(kind, namespace, name, patch)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.kube.delete(kind, namespace, name)


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
class FleetGuard:
    """One tick over every resource; see the module docstring.

    `post(body, events)` publishes events on a resource (kopf.event in the operator)."""

    kube: Kube
    source: Callable[[], MetricsSource]
    post: Callable[[Manifest, list[Event]], None]
    guard_workers: int = 4
    states: dict[str, LoopState] = field(default_factory=dict)
    last_tick_seconds: float = 0.0

    def tick(self, resources: list[Manifest], now: float | None = None) -> int:
        """Guard every resource once; returns how many status patches were written."""
        started = time.monotonic()
        now = time.time() if now is None else now
        namespaces = {str(r["metadata"]["namespace"]) for r in resources}
        snapshot = PodSnapshot.take(self.kube, sorted(namespaces))
        with ThreadPoolExecutor(self.guard_workers, thread_name_prefix="guard") as pool:
            written = sum(pool.map(lambda r: self._guard_one(snapshot, r, now), resources))
        live = {str(r["metadata"]["uid"]) for r in resources}
        for uid in set(self.states) - live:  # deleted resources
            del self.states[uid]
        self.last_tick_seconds = time.monotonic() - started
        return written

    def _guard_one(self, snapshot: PodSnapshot, resource: Manifest, now: float) -> int:
        meta = resource["metadata"]
        try:
            parsed = parse_spec(dict(resource.get("spec", {})))
        except ValidationError:
            return 0  # the spec handlers report it
        current = dict(resource.get("status") or {})
        try:
            result = guard_tick(
                snapshot,
                self.source(),
                name=str(meta["name"]),
                namespace=str(meta["namespace"]),
                spec=parsed.anomaly_guard,
                state=self.states.setdefault(str(meta["uid"]), LoopState()),
                now=now,
                counts=pool_counts(current),
                bounds=ScaleBounds(parsed.ratio.min, parsed.ratio.max, parsed.ratio.gpu_budget),
            )
            self.post(resource, result.events)
            changes = status_changes(current, anomaly_status(result))
            if changes:
                self.kube.patch_status(c.KIND, str(meta["namespace"]), str(meta["name"]), changes)
        except Exception:  # one resource's failure must not stop the others' guard
            log.exception("anomaly tick of %s/%s failed", meta["namespace"], meta["name"])
            return 0
        return 1 if changes else 0

"""The operator's own Prometheus metrics (served by `__main__` on --metrics-port).

Written by `kube.py` (API requests), `passes.py` (reconcile passes, and the per-fleet gauges
from each status it computes) and `handlers.py` (fleet ticks); read by Prometheus, the Grafana
dashboard, the operator-scale benchmark and anyone debugging a slow or noisy
operator.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

API_REQUESTS = Counter(
    "cas_operator_api_requests_total",
    "Requests cas-operator sent to the API server (kopf's own watches excluded)",
    ["verb", "kind", "code"],
)
RECONCILE_SECONDS = Histogram(
    "cas_operator_reconcile_seconds",
    "Duration of one reconcile pass; trigger: spec (create/update), resume, refresh (a child "
    "changed, the anomaly loop found something, or the timer), timer (the periodic full apply)",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter(
    "cas_operator_reconcile_problems_total",
    "Problems found by reconcile passes (invalid specs, failed applies, missing APIs)",
    ["reason"],
)
STATUS_WRITES = Counter(
    "cas_operator_status_writes_total", "Reconcile passes that changed the status"
)
GUARD_TICK_SECONDS = Histogram(
    "cas_operator_guard_tick_seconds",
    "Duration of one anomaly-loop tick over every resource (pod LIST, scrapes, drains)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REFRESH_WAIT_SECONDS = Histogram(
    "cas_operator_refresh_wait_seconds",
    "From a child workload's change (or the anomaly loop's finding) to the start of the pass "
    "it queued: how far the refresh workers are behind",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

LEADER = Gauge(
    "cas_operator_leader",
    "1 while this process holds the leader-election Lease and acts (0: standing by)",
)


# Per-fleet gauges, mirrored from each resource's status after every pass (`record_fleet`):
# what the Grafana dashboard (charts/cas-operator/dashboards/) shows beside the engines' and
# routers' own metrics. Labels: the resource's namespace and name.
POOL_INSTANCES = Gauge(
    "cas_operator_pool_instances",
    "Instances of a fleet's pool: state desired (the plan) or ready (current revision)",
    ["namespace", "name", "pool", "state"],
)
POOL_DRAINING = Gauge(
    "cas_operator_pool_draining",
    "Pods of a fleet's pool out of rotation by the operator (draining or retiring)",
    ["namespace", "name", "pool"],
)
POOL_ANOMALY_RATE = Gauge(
    "cas_operator_pool_anomaly_rate",
    "A fleet's pool-wide quality-gate trip rate over the anomaly window (status.anomaly.pools)",
    ["namespace", "name", "pool"],
)
FLEET_CONDITION = Gauge(
    "cas_operator_fleet_condition",
    "1 while a fleet's condition (Ready, Progressing, Degraded, ...) is True, else 0",
    ["namespace", "name", "type"],
)
FLEET_REVISION = Gauge(
    "cas_operator_fleet_revision",
    "1 for the revision a fleet is at; serving: whether the entry Service sends to it",
    ["namespace", "name", "revision", "serving"],
)
RECENT_DRAINS = Gauge(
    "cas_operator_recent_drains",
    "Drains the anomaly loop started in the last hour (status.anomaly.recentDrains)",
    ["namespace", "name"],
)
ADMISSION_RATE = Gauge(
    "cas_operator_admission_requests_per_second",
    "The request rate a fleet's routers admit in all (status.admission.requestsPerSecond)",
    ["namespace", "name"],
)
ADMISSION_REFUSED = Gauge(
    "cas_operator_admission_refused_per_second",
    "429s a fleet's routers answered per second over the fleet tick's window, retries included "
    "(status.admission.refusedPerSecond)",
    ["namespace", "name"],
)
_FLEET_GAUGES = (
    ADMISSION_RATE,
    ADMISSION_REFUSED,
    POOL_INSTANCES,
    POOL_DRAINING,
    POOL_ANOMALY_RATE,
    FLEET_CONDITION,
    FLEET_REVISION,
    RECENT_DRAINS,
)
_fleet_series: dict[tuple[str, str], set[tuple[Gauge, tuple[str, ...]]]] = {}


def fleet_values(status: dict[str, Any]) -> list[tuple[Gauge, tuple[str, ...], float]]:
    """The per-fleet gauge values one status gives (labels after namespace and name)."""
    values: list[tuple[Gauge, tuple[str, ...], float]] = []
    for pool in ("prefill", "decode"):
        section = status.get(pool) or {}
        for state, key in (("desired", "replicas"), ("ready", "readyReplicas")):
            if key in section:
                values.append((POOL_INSTANCES, (pool, state), float(section[key])))
        draining = [d for d in status.get("draining") or [] if d.get("role") == pool]
        values.append((POOL_DRAINING, (pool,), float(len(draining))))
    anomaly = status.get("anomaly") or {}
    for pool, rate in (anomaly.get("pools") or {}).items():
        values.append((POOL_ANOMALY_RATE, (pool,), float(rate)))
    admission = status.get("admission") or {}
    for gauge, key in (
        (ADMISSION_RATE, "requestsPerSecond"),
        (ADMISSION_REFUSED, "refusedPerSecond"),
    ):
        if admission.get(key) is not None:
            values.append((gauge, (), float(admission[key])))
    if "recentDrains" in anomaly:
        values.append((RECENT_DRAINS, (), float(len(anomaly["recentDrains"] or []))))
    for cond in status.get("conditions") or []:
        values.append((FLEET_CONDITION, (cond["type"],), float(cond["status"] == "True")))
    if status.get("revision"):
        serving = status.get("servingRevision") == status["revision"]
        values.append((FLEET_REVISION, (status["revision"], str(serving).lower()), 1.0))
    return values


def record_fleet(namespace: str, name: str, status: dict[str, Any]) -> None:
    """Set the fleet's gauges from its status; series it no longer has are removed."""
    now: set[tuple[Gauge, tuple[str, ...]]] = set()
    for gauge, labels, value in fleet_values(status):
        full = (namespace, name, *labels)
        gauge.labels(*full).set(value)
        now.add((gauge, full))
    for gauge, full in _fleet_series.get((namespace, name), set()) - now:
        gauge.remove(*full)
    _fleet_series[(namespace, name)] = now


def forget_fleet(namespace: str, name: str) -> None:
    """A deleted resource's series go."""
    for gauge, full in _fleet_series.pop((namespace, name), set()):
        gauge.remove(*full)

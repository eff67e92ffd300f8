"""The operator's own Prometheus metrics (served by `__main__` on --metrics-port).

Written by `kube.py` (API requests), `passes.py` (reconcile passes) and `handlers.py` (fleet
ticks); read by Prometheus, the operator-scale benchmark and anyone debugging a slow or noisy
operator.
"""

from __future__ import annotations

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

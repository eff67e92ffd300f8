"""The operator's per-fleet gauges mirror the status it writes (the dashboard's fleet panels;
their queries run against Prometheus in e2e/tests/test_dashboard.py)."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from cas_operator import metrics

STATUS: dict[str, Any] = {
    "revision": "r1",
    "servingRevision": "r0",
    "prefill": {"replicas": 1, "readyReplicas": 1},
    "decode": {"replicas": 3, "readyReplicas": 2},
    "draining": [{"pod": "d-1", "role": "decode"}],
    "anomaly": {"pools": {"decode": 0.002}, "recentDrains": ["t1", "t2"]},
    "conditions": [{"type": "Ready", "status": "False"}, {"type": "Degraded", "status": "True"}],
    "admission": {"mode": "Auto", "requestsPerSecond": 12.5, "refusedPerSecond": 3.0},
}


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": "ns", "name": "fm", **labels})


def test_the_gauges_follow_the_status_and_go_with_the_fleet() -> None:
    metrics.record_fleet("ns", "fm", STATUS)
    assert value("cas_operator_pool_instances", pool="decode", state="desired") == 3
    assert value("cas_operator_pool_instances", pool="decode", state="ready") == 2
    assert value("cas_operator_pool_draining", pool="decode") == 1
    assert value("cas_operator_pool_draining", pool="prefill") == 0
    assert value("cas_operator_pool_anomaly_rate", pool="decode") == 0.002
    assert value("cas_operator_recent_drains") == 2
    assert value("cas_operator_admission_requests_per_second") == 12.5
    assert value("cas_operator_admission_refused_per_second") == 3.0
    assert value("cas_operator_fleet_condition", type="Degraded") == 1
    assert value("cas_operator_fleet_condition", type="Ready") == 0
    assert value("cas_operator_fleet_revision", revision="r1", serving="false") == 1
    # the new revision serves: the old series goes, not left at 1 beside the new one
    metrics.record_fleet("ns", "fm", {**STATUS, "servingRevision": "r1", "revision": "r1"})
    assert value("cas_operator_fleet_revision", revision="r1", serving="false") is None
    assert value("cas_operator_fleet_revision", revision="r1", serving="true") == 1
    metrics.forget_fleet("ns", "fm")
    assert value("cas_operator_pool_instances", pool="decode", state="desired") is None
    assert value("cas_operator_fleet_revision", revision="r1", serving="true") is None

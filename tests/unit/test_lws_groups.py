"""LeaderWorkerSet groups with a pod leaving: the pure decision (`anomaly.groups`) and the
tick that acts on it (`anomaly.act`), over the in-memory pod API of tests/fakes.py.

Regression guarded (issue 41, item 8): deleting or evicting an LWS worker pod never took its
leader out of rotation: the worker's preStop waits for a leader that keeps receiving requests,
and once the worker stops, the group's requests fail. Only LeaderWorkerSet's own restart
policy (it deletes the leader) stood between them; the operator now takes the leader out
(serving label off, deregistered from every router replica) whatever that controller does.
"""

from __future__ import annotations

from typing import Any

from cas_operator.anomaly.act import LoopState, anomaly_tick
from cas_operator.anomaly.drain import ANNOTATION_DRAIN_REASON, draining_since
from cas_operator.anomaly.groups import LWS_SET_LABEL, GroupLeaving, groups_leaving
from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.fleet_tick import slim_pod
from cas_operator.observe.types import PodSignals
from tests.fakes import CannedMetrics, MemoryPods, RecordingRouters

T0 = 1_800_000_000.0
BORN = "2027-01-15T08:00:00Z"  # before T0's deletions


def group(index: int, size: int = 2, set_name: str = "demo-decode-r1") -> list[dict[str, Any]]:
    """One LWS group as LWS labels it: the leader (worker index 0, serving) and its workers."""
    pods = []
    for worker in range(size):
        labels = {c.LABEL_NAME: "demo", c.LABEL_APP_NAME: c.APP_ENGINE, c.LABEL_ROLE: "decode",
                  LWS_SET_LABEL: set_name, c.LWS_GROUP_INDEX_LABEL: str(index),
                  c.LWS_WORKER_INDEX_LABEL: str(worker)}  # fmt: skip
        if worker == 0:
            labels[c.LABEL_SERVING] = "true"
        name = f"{set_name}-{index}" + (f"-{worker}" if worker else "")
        pods.append({
            "metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": {},
                         "creationTimestamp": BORN},
            "status": {"podIP": f"100.96.1.{10 * index + worker + 1}",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })  # fmt: skip
    return pods


def deleted(pod: dict[str, Any], at: str = "2027-01-15T08:20:00Z", grace: int = 630) -> None:
    """What a DELETE (or an eviction) leaves on the pod: the deadline and its grace."""
    pod["metadata"]["deletionTimestamp"] = at
    pod["metadata"]["deletionGracePeriodSeconds"] = grace


def test_a_leaving_worker_takes_its_leader_and_only_its_leader_out() -> None:
    pods = group(0) + group(1)
    deleted(pods[3])  # group 1's worker
    assert groups_leaving(pods) == [
        GroupLeaving("demo-decode-r1-1", "demo-decode-r1-1-1", leader_deleting=False)
    ]
    deleted(pods[2])  # its leader too (LWS's restart policy deletes it)
    assert groups_leaving(pods)[0].leader_deleting


def test_groups_are_told_apart_by_their_set_and_incarnation() -> None:
    """Group 0 of another LeaderWorkerSet (a canary's) is another group; a worker of an
    earlier incarnation still terminating does not count, even when its deletion was asked
    after this leader was created (its leader was evicted, a background deletion: the old
    worker StatefulSet and its pods are garbage-collected after the new leader exists): a
    recreated group must not be drained again, over and over."""
    ours, canary = group(0), group(0, set_name="demo-decode-r2")
    deleted(canary[1])
    assert [g.leader for g in groups_leaving(ours + canary)] == ["demo-decode-r2-0"]
    for asked_at in ("2027-01-15T08:10:00Z", "2027-01-15T08:20:00Z"):  # 07:59:30, 08:09:30
        old = group(0)[1]
        old["metadata"]["name"] = "demo-decode-r1-0-1-old"
        old["metadata"]["creationTimestamp"] = "2027-01-15T07:50:00Z"  # before this leader
        deleted(old, at=asked_at, grace=630)
        assert groups_leaving([*ours, old]) == [], asked_at
        # as the fleet tick reads them (its slimmed pods keep their creation times)
        assert groups_leaving([slim_pod(p) for p in (*ours, old)]) == [], asked_at
    # this incarnation's worker (created the same second as its leader) counts
    deleted(ours[1])
    assert [g.leader for g in groups_leaving([slim_pod(p) for p in ours])] == ["demo-decode-r1-0"]


def test_single_node_pods_are_no_group() -> None:
    pod = group(0, size=1)[0]
    for key in (LWS_SET_LABEL, c.LWS_GROUP_INDEX_LABEL, c.LWS_WORKER_INDEX_LABEL):
        del pod["metadata"]["labels"][key]
    deleted(pod)
    assert groups_leaving([pod]) == []


def tick(api: MemoryPods, routers: RecordingRouters, t: float = 0.0) -> Any:
    return anomaly_tick(
        api, CannedMetrics(), name="demo", namespace="ns", spec=AnomalyGuardSpec(),
        state=LoopState(), now=T0 + t, routers=routers,
    )  # fmt: skip


def test_a_deleted_worker_drains_its_running_leader_from_every_router() -> None:
    """The LeaderWorkerSet controller has not acted (it is down, or slow): the leader still
    runs. The tick starts its drain (label off, the reason recorded) and every router replica
    drops it; the other group stays in rotation, and the workers are never touched."""
    api, routers = MemoryPods(group(0) + group(1)), RecordingRouters()
    deleted(api.pod("demo-decode-r1-1-1"))
    result = tick(api, routers)
    leader = api.pod("demo-decode-r1-1")
    assert c.LABEL_SERVING not in leader["metadata"]["labels"]
    assert draining_since(leader) == T0
    assert "demo-decode-r1-1-1" in leader["metadata"]["annotations"][ANNOTATION_DRAIN_REASON]
    assert routers.removed == ["http://100.96.1.11:30000"]
    assert api.pod("demo-decode-r1-0")["metadata"]["labels"][c.LABEL_SERVING] == "true"
    assert {name for _, name in api.calls} == {"demo-decode-r1-1"}
    assert [e[1] for e in result.events] == ["PodDraining", "WorkerDeregistered"]
    # idle: the drain path removes the leader (LWS recreates the whole group)
    source = CannedMetrics()
    source.by_name["demo-decode-r1-1"] = PodSignals(checked=0, trips_low_accept=0,
                                                    trips_high_accept=0, running=0)  # fmt: skip
    anomaly_tick(api, source, name="demo", namespace="ns", spec=AnomalyGuardSpec(),
                 state=LoopState(), now=T0 + 30, routers=routers)  # fmt: skip
    assert ("evict", "demo-decode-r1-1") in api.calls


def test_a_leader_already_deleted_with_its_group_loses_its_serving_label() -> None:
    """LeaderWorkerSet deleted the leader when its worker left: the leader is deregistered (as
    every deleted pod) and now loses its serving label too, so nothing rediscovers it while
    its preStop drains it."""
    api, routers = MemoryPods(group(0)), RecordingRouters()
    deleted(api.pod("demo-decode-r1-0-1"))
    deleted(api.pod("demo-decode-r1-0"))
    result = tick(api, routers)
    assert c.LABEL_SERVING not in api.pod("demo-decode-r1-0")["metadata"]["labels"]
    assert routers.removed == ["http://100.96.1.1:30000"]
    assert [e[1] for e in result.events] == ["PodOutOfRotation", "WorkerDeregistered"]
    tick(api, routers, 5)
    assert api.calls == [("patch", "demo-decode-r1-0")]  # once

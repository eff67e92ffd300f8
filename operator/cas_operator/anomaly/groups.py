"""Multi-node instances (LeaderWorkerSet groups) whose group is leaving (pure).

Only a group's leader serves (the routers know only it), but every request needs every pod
of the group. When any pod of a group is deleted or evicted (a node drain, a user, the
scheduler), the group cannot serve much longer: a worker's preStop waits for its leader, and
once it stops the leader's requests fail. So the leader leaves rotation at once, whatever
else acts: its serving label goes and every router replica drops it (`anomaly.act`), as drains
do. LeaderWorkerSet's own RecreateGroupOnPodRestart deletes the leader too (within a second on
the local stack), but the operator must not depend on that controller being up.

Input: the resource's engine pods as listed (leaders and workers, deleting ones included).
Output: one `GroupLeaving` per leader whose group has a pod being deleted, the leader itself
included (LeaderWorkerSet deletes it when any pod of its group goes). A worker counts only
if it was created with or after its leader (this incarnation's workers are made by the
leader's own worker StatefulSet): a recreated group's new leader may run while the old
group's workers still terminate, and their deletion can be asked after the new leader was
created (a leader deleted with background propagation, e.g. evicted: its worker StatefulSet
and pods are garbage-collected after it is gone); draining the new leader for them would
recreate the group over and over. LeaderWorkerSet v0.9 tells them apart by owner UIDs
(`pod_controller.go`, `workerPodBelongsToLeader`); the pods' creation times say the same
without reading the StatefulSets (an old worker was created before the old leader left,
so before the new one was created). This module reads pods and decides; `anomaly.act` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cas_operator.api import constants as c
from cas_operator.types import Manifest, parse_time

LWS_SET_LABEL: Final = "leaderworkerset.sigs.k8s.io/name"  # set by LWS on every group pod


@dataclass(frozen=True)
class GroupLeaving:
    """`leader` must leave rotation because `pod` of its group (maybe itself) is being deleted."""

    leader: str
    pod: str
    leader_deleting: bool  # the leader itself is being deleted already

    @property
    def reason(self) -> str:
        return f"its LeaderWorkerSet group is leaving (pod {self.pod} is being deleted)"


def _group(pod: Manifest) -> tuple[str, str] | None:
    labels = pod.get("metadata", {}).get("labels") or {}
    name, index = labels.get(LWS_SET_LABEL), labels.get(c.LWS_GROUP_INDEX_LABEL)
    if name is None or index is None or labels.get(c.LWS_WORKER_INDEX_LABEL) is None:
        return None
    return str(name), str(index)


def _this_incarnation(pod: Manifest, leader: Manifest) -> bool:
    """Whether `pod` belongs to `leader`'s incarnation of the group: the leader itself, or a
    worker created with or after it (timestamps have whole seconds: the same second counts)."""
    if pod is leader:
        return True
    born = parse_time(leader["metadata"].get("creationTimestamp"))
    created = parse_time(pod["metadata"].get("creationTimestamp"))
    return born is None or created is None or created >= born


def groups_leaving(pods: list[Manifest]) -> list[GroupLeaving]:
    """Every leader whose group has a pod being deleted (see the module docstring), by name."""
    leaders: dict[tuple[str, str], Manifest] = {}
    for pod in pods:
        group = _group(pod)
        if group is not None and pod["metadata"]["labels"][c.LWS_WORKER_INDEX_LABEL] == "0":
            leaders[group] = pod
    found: dict[str, GroupLeaving] = {}
    for pod in pods:
        group = _group(pod)
        leader = leaders.get(group) if group is not None else None
        if leader is None or not pod["metadata"].get("deletionTimestamp"):
            continue
        if not _this_incarnation(pod, leader):
            continue  # an earlier incarnation's worker, still terminating
        name = leader["metadata"]["name"]
        deleting = bool(leader["metadata"].get("deletionTimestamp"))
        found.setdefault(name, GroupLeaving(name, pod["metadata"]["name"], deleting))
    return [found[n] for n in sorted(found)]

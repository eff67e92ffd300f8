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
included (LeaderWorkerSet deletes it when any pod of its group goes). A pod counts only
if its deletion was asked after the leader was created: a recreated group's new leader may
run while the old group's workers still terminate. This module reads pods and decides;
`anomaly.act` writes.
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


def _deletion_asked(pod: Manifest) -> float | None:
    """When the pod's deletion was asked (its deletionTimestamp is that time plus its grace)."""
    meta = pod.get("metadata", {})
    deadline = parse_time(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    return deadline - float(meta.get("deletionGracePeriodSeconds") or 0)


def groups_leaving(pods: list[Manifest]) -> list[GroupLeaving]:
    """Every leader whose group has a pod being deleted (see the module docstring), by name."""
    leaders: dict[tuple[str, str], Manifest] = {}
    for pod in pods:
        group = _group(pod)
        if group is not None and pod["metadata"]["labels"][c.LWS_WORKER_INDEX_LABEL] == "0":
            leaders[group] = pod
    found: dict[str, GroupLeaving] = {}
    for pod in pods:
        group, asked = _group(pod), _deletion_asked(pod)
        leader = leaders.get(group) if group is not None else None
        if leader is None or asked is None:
            continue
        born = parse_time(leader["metadata"].get("creationTimestamp"))
        if born is not None and asked < born:
            continue  # an earlier incarnation's pod, still terminating
        name = leader["metadata"]["name"]
        deleting = bool(leader["metadata"].get("deletionTimestamp"))
        found.setdefault(name, GroupLeaving(name, pod["metadata"]["name"], deleting))
    return [found[n] for n in sorted(found)]

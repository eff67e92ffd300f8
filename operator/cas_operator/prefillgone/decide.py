"""The prefill-gone loop's pure half: which ended prefill pods are confirmed, and the feed.

`confirmed_end(pod)` reads the last copy of a deleted prefill pod and returns a `GoneEntry`
(bootstrap address and the time its containers finished), a `GroupMember` (a pod of a
LeaderWorkerSet group: every rank of the group writes KV, so one pod's end proves nothing) or
`Unconfirmed` with the reason. `complete_groups` turns the members seen so far into one entry
per group whose leader and every worker of that incarnation ended confirmed (at the leader's
bootstrap address and finish), keeping the rest pending.
`merge_entries` folds an entry into the feed (one per pod uid, newest `FEED_CAP`, none older
than `FEED_TTL_S`); `feed_text` / `parse_feed_text` are the wire format decode reads
(cas_engine.kvfence.gone_feed.parse_feed; a contract test holds them together);
`pending_text` / `parse_pending_text` hold the members of unfinished groups in the same
ConfigMap (a key decode does not read), so an operator restart loses none.
No I/O, no clock: the caller passes `now`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cas_operator.api import constants as c
from cas_operator.types import Manifest, parse_time, rfc3339

FEED_VERSION = 1
FEED_TTL_S = 3600.0  # decode aborts a dead prefill's rooms within minutes; keep an hour
FEED_CAP = 512  # entries (~150 bytes each: far below a ConfigMap's 1 MiB)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"  # sha1(namespace/leader name)
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0": the leader
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"  # pods per group, leader included


@dataclass(frozen=True)
class GoneEntry:
    """A prefill pod whose end the kubelet confirmed."""

    bootstrap: str  # host:port decode dials (IPv6 bracketed)
    finished_at: str  # RFC 3339: the last of its containers' finishedAt
    pod: str  # namespace/name, for people reading the ConfigMap
    uid: str

    def as_json(self) -> dict[str, str]:
        return {
            "bootstrap": self.bootstrap,
            "finishedAt": self.finished_at,
            "pod": self.pod,
            "uid": self.uid,
        }


@dataclass(frozen=True)
class Unconfirmed:
    """A prefill pod gone without the kubelet's word that nothing of it runs. ``alarm``: it
    may have written KV and may still run (a force delete), worth a Warning event; else it
    never served, or is a kind the loop does not track (a log line is enough)."""

    pod: str
    reason: str
    alarm: bool = False


@dataclass(frozen=True)
class GroupMember:
    """A LeaderWorkerSet group's pod whose end the kubelet confirmed. A group is one
    incarnation of (namespace, LWS, group-key): LWS recreates a group under the same pod names,
    and a worker belongs to the leader it was created under (after the leader, before the
    leader's end)."""

    group: str  # namespace/lws/group-key
    uid: str
    pod: str  # namespace/name
    leader: bool
    size: int
    created_at: str  # RFC 3339
    finished_at: str  # RFC 3339: the last of its containers' finishedAt
    bootstrap: str | None  # the leader's: the address decode dialled

    def as_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "uid": self.uid,
            "pod": self.pod,
            "leader": self.leader,
            "size": self.size,
            "createdAt": self.created_at,
            "finishedAt": self.finished_at,
            "bootstrap": self.bootstrap,
        }


def _bootstrap(pod: Manifest) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    port = ((pod.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_BOOTSTRAP_PORT)
    if not ip or not str(port or "").isdigit():
        return None
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else str(ip)
    return f"{host}:{int(str(port))}"


def confirmed_end(pod: Manifest) -> GoneEntry | GroupMember | Unconfirmed:
    """Whether this deleted prefill pod's end is confirmed, from its last copy."""
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    labels = meta.get("labels") or {}
    if labels.get(LWS_NAME_LABEL):
        return _group_member(pod, name)
    bootstrap = _bootstrap(pod)
    if bootstrap is None:
        return Unconfirmed(name, "no pod IP or bootstrap port: it never served")
    finished = _finished(pod, name)
    if isinstance(finished, Unconfirmed):
        return finished
    return GoneEntry(bootstrap, rfc3339(finished), name, str(meta.get("uid", "")))


def _finished(pod: Manifest, name: str) -> float | Unconfirmed:
    """When the last of the pod's containers finished, as the kubelet reported it."""
    statuses: list[dict[str, Any]] = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return Unconfirmed(name, "no container status: nothing says its containers stopped")
    finished: list[float] = []
    for status in statuses:
        terminated = (status.get("state") or {}).get("terminated") or {}
        at = parse_time(terminated.get("finishedAt"))
        if at is None:
            return Unconfirmed(
                name,
                f"container {status.get('name')!r} not reported terminated (force-deleted, or "
                "its node is gone): its writes may still land",
                alarm=True,
            )
        finished.append(at)
    return max(finished)


def _group_member(pod: Manifest, name: str) -> GroupMember | Unconfirmed:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    size = str((meta.get("annotations") or {}).get(LWS_SIZE_ANNOTATION, ""))
    key = labels.get(LWS_GROUP_KEY_LABEL)
    created = parse_time(meta.get("creationTimestamp"))
    if not key or not size.isdigit() or created is None:
        return Unconfirmed(name, "a LeaderWorkerSet pod without its group key, size or creation")
    leader = str(labels.get(LWS_WORKER_INDEX_LABEL, "0")) == "0"
    bootstrap = _bootstrap(pod) if leader else None
    if leader and bootstrap is None:
        return Unconfirmed(name, "a group leader without pod IP or bootstrap port: it never served")
    finished = _finished(pod, name)
    if isinstance(finished, Unconfirmed):
        return finished
    group = f"{meta.get('namespace', '')}/{labels[LWS_NAME_LABEL]}/{key}"
    return GroupMember(
        group,
        str(meta.get("uid", "")),
        name,
        leader,
        int(size),
        rfc3339(created),
        rfc3339(finished),
        bootstrap,
    )


@dataclass(frozen=True)
class GroupProgress:
    """`complete_groups`' answer: a feed entry per finished group, the members still waiting."""

    ended: list[GoneEntry]
    pending: list[GroupMember]


def _incarnation(leader: GroupMember, members: list[GroupMember]) -> list[GroupMember]:
    start = parse_time(leader.created_at) or 0.0
    end = parse_time(leader.finished_at) or 0.0
    return [
        m
        for m in members
        if not m.leader
        and m.group == leader.group
        and start <= (parse_time(m.created_at) or 0.0) <= end
    ]


def complete_groups(members: Iterable[GroupMember], now: float) -> GroupProgress:
    """The groups whose leader and all `size - 1` workers of its incarnation ended confirmed,
    each as one entry at the leader's bootstrap address and finish; the other
    members stay pending (for `FEED_TTL_S`: a member whose group never completes, such as a
    force-deleted worker's, stops waiting then, and its rooms stay held as before)."""
    by_uid = {m.uid: m for m in members}
    waiting = [m for m in by_uid.values() if (parse_time(m.finished_at) or 0.0) >= now - FEED_TTL_S]
    ended: list[GoneEntry] = []
    done: set[str] = set()
    for leader in sorted((m for m in waiting if m.leader), key=lambda m: m.finished_at):
        workers = _incarnation(leader, waiting)
        if len(workers) < leader.size - 1 or leader.bootstrap is None:
            continue
        # The leader's finish, not the last worker's: a room handshaken before it was this
        # incarnation's (a new leader starts only after this one's object is gone, possibly
        # before its workers finished); that every writer has stopped is what the entry's
        # appearance says (only now, with every member's end confirmed).
        pod = f"{leader.pod} (group of {leader.size})"
        ended.append(GoneEntry(leader.bootstrap, leader.finished_at, pod, leader.uid))
        done.update(m.uid for m in [leader, *workers])
    pending = sorted((m for m in waiting if m.uid not in done), key=lambda m: m.finished_at)
    return GroupProgress(ended, pending)


@dataclass(frozen=True)
class FeedUpdate:
    """The feed and the pending members once an end is in them; `ended`: the entries it added
    (none while a group waits for the rest of its pods)."""

    entries: list[GoneEntry]
    pending: list[GroupMember]
    ended: list[GoneEntry]


def updated_feed(
    feed: list[GoneEntry], pending: list[GroupMember], end: GoneEntry | GroupMember, now: float
) -> FeedUpdate:
    if isinstance(end, GoneEntry):
        return FeedUpdate(merge_entries(feed, end, now), pending, [end])
    progress = complete_groups([*pending, end], now)
    entries = feed
    for entry in progress.ended:
        entries = merge_entries(entries, entry, now)
    return FeedUpdate(entries, progress.pending, progress.ended)


def pending_text(members: Iterable[GroupMember]) -> str:
    """The ConfigMap value holding unfinished groups' members (`c.PREFILL_GONE_PENDING_KEY`)."""
    doc = {"version": FEED_VERSION, "members": [m.as_json() for m in members]}
    return json.dumps(doc, indent=1, sort_keys=True)


def parse_pending_text(text: str | None) -> list[GroupMember]:
    """The members `pending_text` wrote; [] for none or an unreadable value."""
    try:
        doc = json.loads(text or "")
        items = doc["members"] if doc.get("version") == FEED_VERSION else []
        return [
            GroupMember(
                str(i["group"]),
                str(i["uid"]),
                str(i.get("pod", "")),
                bool(i["leader"]),
                int(i["size"]),
                str(i["createdAt"]),
                str(i["finishedAt"]),
                None if i.get("bootstrap") is None else str(i["bootstrap"]),
            )
            for i in items
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def merge_entries(
    entries: Iterable[GoneEntry],
    new: GoneEntry,
    now: float,
    *,
    ttl_s: float = FEED_TTL_S,
    cap: int = FEED_CAP,
) -> list[GoneEntry]:
    """The feed with `new` in it: one entry per pod uid, none older than `ttl_s`, the newest
    `cap`, oldest first."""
    by_uid = {e.uid: e for e in entries}
    by_uid[new.uid] = new
    fresh = [e for e in by_uid.values() if (parse_time(e.finished_at) or 0.0) >= now - ttl_s]
    fresh.sort(key=lambda e: (parse_time(e.finished_at) or 0.0, e.uid))
    return fresh[-cap:]


def feed_text(entries: Iterable[GoneEntry]) -> str:
    """The ConfigMap value decode reads (`c.PREFILL_GONE_KEY`)."""
    doc = {"version": FEED_VERSION, "prefills": [e.as_json() for e in entries]}
    return json.dumps(doc, indent=1, sort_keys=True)


def parse_feed_text(text: str | None) -> list[GoneEntry]:
    """The entries of a feed this operator wrote; [] for none or an unreadable one (a feed
    someone broke is rewritten from the next entry on: decode keeps what it already read)."""
    try:
        doc = json.loads(text or "")
        items = doc["prefills"] if doc.get("version") == FEED_VERSION else []
        return [
            GoneEntry(
                str(i["bootstrap"]), str(i["finishedAt"]), str(i.get("pod", "")), str(i["uid"])
            )
            for i in items
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
